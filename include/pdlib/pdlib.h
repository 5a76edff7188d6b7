// Umbrella header: everything an engine needs to use pdlib.
#ifndef PDLIB_PDLIB_H_
#define PDLIB_PDLIB_H_

#include "pdlib/backends.h"
#include "pdlib/export.h"
#include "pdlib/kv_args.h"
#include "pdlib/kv_manager.h"
#include "pdlib/kv_pool.h"
#include "pdlib/log.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/page_index.h"
#include "pdlib/poll_reduce.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

#endif  // PDLIB_PDLIB_H_
