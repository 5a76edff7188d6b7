/* The C API (include/pdlib/c/pdlib.h), compiled as C99: the life of requests on both sides over
 * the fake backend (which copies the bytes between managers of this process) and over UCX
 * shared memory, chunked and layer-wise sends, two state families, a decode prefix, pull, and
 * the error paths (bad index, wrong order, NULLs, a struct from a newer caller), each returning
 * its code and message. Every transfer compares the bytes.
 *
 *   c_api_test [case]   runs every case, or those whose name contains `case`
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pdlib/c/pdlib.h"

static int failures = 0;

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              pdlib_last_error());                                                             \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)
#define REQUIRE(cond)                                                                            \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      fprintf(stderr, "%s:%d: REQUIRE failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              pdlib_last_error());                                                               \
      ++failures;                                                                                \
      return;                                                                                    \
    }                                                                                            \
  } while (0)

enum {
  kLayers = 2,
  kBuffers = 2 * kLayers,
  kPages = 16,
  kPage = 512,
  kAuxRows = 8,
  kAuxRow = 64,
  kSlots = 4,
  kMambaItem = 256,
  kSwaItem = 128,
  kPageTokens = 4
};

/* One side's memory: K and V of each layer, one aux buffer, a mamba slot pool, a swa page pool. */
typedef struct Side {
  unsigned char kv[kBuffers][kPages * kPage];
  unsigned char aux[kAuxRows * kAuxRow];
  unsigned char mamba[kSlots * kMambaItem];
  unsigned char swa[kPages * kSwaItem];
  uint64_t kv_ptrs[kBuffers], kv_lens[kBuffers], kv_items[kBuffers];
  uint64_t aux_ptr, aux_len, aux_item;
  uint64_t mamba_ptr, mamba_len, mamba_item, swa_ptr, swa_len, swa_item;
  pdlib_state_family families[2];
  pdlib_manager* manager;
} Side;

typedef struct Setup {
  const char* backend;
  pdlib_direction direction;
  int families;
  /* The state families as a caller built against an older header passes them: elements without
   * the last field (`start`), packed at that smaller stride. */
  int older_families;
} Setup;

static unsigned char packed_families[2][2 * sizeof(pdlib_state_family)];

static uint16_t next_port = 27100;

static void Fill(Side* s, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  size_t b, i;
  for (b = 0; b < kBuffers; ++b) {
    for (i = 0; i < sizeof s->kv[b]; ++i)
      s->kv[b][i] = (unsigned char)((x = x * 1103515245u + 12345u) >> 16);
  }
  for (i = 0; i < sizeof s->aux; ++i)
    s->aux[i] = (unsigned char)((x = x * 1103515245u + 12345u) >> 16);
  for (i = 0; i < sizeof s->mamba; ++i)
    s->mamba[i] = (unsigned char)((x = x * 1103515245u + 12345u) >> 16);
  for (i = 0; i < sizeof s->swa; ++i)
    s->swa[i] = (unsigned char)((x = x * 1103515245u + 12345u) >> 16);
}

static pdlib_status Start(Side* s, pdlib_mode mode, uint16_t port, const Setup* setup) {
  pdlib_manager_options o;
  pdlib_key_value kv_fake[1] = {{"fake.copy", "true"}};
  pdlib_key_value kv_ucx[1] = {{"ucx.tls", "shm"}};
  size_t b;
  pdlib_manager_options_init(&o);
  o.mode = mode;
  o.backend = setup->backend;
  if (strcmp(setup->backend, "fake") == 0) o.backend_options = kv_fake;
  if (strcmp(setup->backend, "ucx") == 0) o.backend_options = kv_ucx;
  o.backend_option_count = 1;
  o.control_plane = PDLIB_CONTROL_IN_PROCESS;
  o.direction = setup->direction;
  o.bootstrap_port = port;
  for (b = 0; b < kBuffers; ++b) {
    s->kv_ptrs[b] = (uint64_t)(uintptr_t)s->kv[b];
    s->kv_lens[b] = sizeof s->kv[b];
    s->kv_items[b] = kPage;
  }
  o.kv.ptrs = s->kv_ptrs;
  o.kv.lens = s->kv_lens;
  o.kv.item_lens = s->kv_items;
  o.kv.count = kBuffers;
  s->aux_ptr = (uint64_t)(uintptr_t)s->aux;
  s->aux_len = sizeof s->aux;
  s->aux_item = kAuxRow;
  o.aux.ptrs = &s->aux_ptr;
  o.aux.lens = &s->aux_len;
  o.aux.item_lens = &s->aux_item;
  o.aux.count = 1;
  if (setup->families) {
    s->mamba_ptr = (uint64_t)(uintptr_t)s->mamba;
    s->mamba_len = sizeof s->mamba;
    s->mamba_item = kMambaItem;
    s->swa_ptr = (uint64_t)(uintptr_t)s->swa;
    s->swa_len = sizeof s->swa;
    s->swa_item = kSwaItem;
    pdlib_state_family_init(&s->families[0]);
    s->families[0].type = PDLIB_STATE_MAMBA;
    s->families[0].buffers.ptrs = &s->mamba_ptr;
    s->families[0].buffers.lens = &s->mamba_len;
    s->families[0].buffers.item_lens = &s->mamba_item;
    s->families[0].buffers.count = 1;
    pdlib_state_family_init(&s->families[1]);
    s->families[1].type = PDLIB_STATE_SWA;
    s->families[1].buffers.ptrs = &s->swa_ptr;
    s->families[1].buffers.lens = &s->swa_len;
    s->families[1].buffers.item_lens = &s->swa_item;
    s->families[1].buffers.count = 1;
    o.state_families = s->families;
    o.state_family_count = 2;
    if (setup->older_families) {
      const size_t older = offsetof(pdlib_state_family, start);
      unsigned char* packed = packed_families[mode == PDLIB_MODE_PREFILL ? 0 : 1];
      size_t f;
      for (f = 0; f < 2; ++f) {
        s->families[f].struct_size = older;
        memcpy(packed + f * older, &s->families[f], older);
      }
      o.state_families = (const pdlib_state_family*)(const void*)packed;
    }
  }
  o.page_size = kPageTokens;
  o.kv_head_num = 1;
  o.kv_layout = PDLIB_LAYOUT_HND;
  o.num_layers = kLayers;
  o.num_kv_heads = 1;
  o.head_dim = kPage / kPageTokens;
  o.dtype_bytes = 1;
  o.model_name = "c-api-test";
  o.transfer_timeout_ms = 10000;
  return pdlib_manager_create(&o, &s->manager);
}

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void Sleep100us(void) {
  struct timespec t = {0, 100000};
  nanosleep(&t, NULL);
}

/* Polls both until terminal (or `want_sender` for the sender alone), at most 10 s. */
static int WaitSender(pdlib_sender* s, pdlib_poll want) {
  double deadline = Now() + 10;
  while (pdlib_sender_poll(s) < want && pdlib_sender_poll(s) != PDLIB_POLL_FAILED) {
    if (Now() > deadline) return 0;
    Sleep100us();
  }
  return pdlib_sender_poll(s) >= want;
}

static int WaitDone(pdlib_sender* s, pdlib_receiver* r) {
  double deadline = Now() + 10;
  for (;;) {
    pdlib_poll a = pdlib_sender_poll(s), b = pdlib_receiver_poll(r);
    if ((a == PDLIB_POLL_FAILED || a == PDLIB_POLL_SUCCESS) &&
        (b == PDLIB_POLL_FAILED || b == PDLIB_POLL_SUCCESS)) {
      return 1;
    }
    if (Now() > deadline) return 0;
    Sleep100us();
  }
}

typedef struct Pair {
  Setup setup;
  uint16_t port;
  Side* prefill;
  Side* decode;
} Pair;

static int OpenPair(Pair* p, const char* backend, pdlib_direction direction, int families) {
  p->setup.backend = backend;
  p->setup.direction = direction;
  p->setup.families = families;
  p->setup.older_families = families == 2;
  p->port = next_port++;
  p->prefill = (Side*)calloc(1, sizeof(Side));
  p->decode = (Side*)calloc(1, sizeof(Side));
  Fill(p->prefill, 1);
  Fill(p->decode, 2);
  if (Start(p->prefill, PDLIB_MODE_PREFILL, p->port, &p->setup) != PDLIB_OK) return 0;
  if (Start(p->decode, PDLIB_MODE_DECODE, p->port, &p->setup) != PDLIB_OK) return 0;
  return 1;
}

static void ClosePair(Pair* p) {
  pdlib_manager_destroy(p->decode ? p->decode->manager : NULL);
  pdlib_manager_destroy(p->prefill ? p->prefill->manager : NULL);
  free(p->prefill);
  free(p->decode);
}

/* One request: prefill pages src[k] land in decode pages dst[k] (k < n), decode's aux row
 * dst_aux gets prefill's row src_aux; `chunk` pages per Send (0: one chunk), layer-wise when
 * `layers`; with families, a mamba slot and swa pages. Checks every byte. */
typedef struct Request {
  uint64_t room;
  const int32_t* src;
  const int32_t* dst;
  size_t n;
  int32_t src_aux, dst_aux;
  size_t chunk;
  int layers;
  uint64_t prefix_tokens; /* decode prefix (the first prefix_tokens / kPageTokens pages) */
} Request;

static void Run(Pair* p, const Request* q) {
  pdlib_sender* s = NULL;
  pdlib_receiver* r = NULL;
  pdlib_receive_params rp;
  pdlib_send_params sp;
  int32_t mamba_src = 1, mamba_dst = 3;
  int32_t swa_src[2] = {5, 6}, swa_dst[2] = {9, 2};
  int32_t state_src[3], state_dst[3];
  uint32_t counts[2] = {1, 2};
  size_t at, k, b;
  uint64_t prefix = 99;
  REQUIRE(pdlib_sender_create(p->prefill->manager, q->room, &s) == PDLIB_OK);
  REQUIRE(pdlib_receiver_create(p->decode->manager, "127.0.0.1", p->port, q->room, -1, &r) ==
          PDLIB_OK);
  pdlib_receive_params_init(&rp);
  rp.pages = q->dst;
  rp.page_count = q->n;
  rp.aux_index = q->dst_aux;
  rp.decode_prefix_len = q->prefix_tokens;
  if (p->setup.families) {
    state_dst[0] = mamba_dst;
    state_dst[1] = swa_dst[0];
    state_dst[2] = swa_dst[1];
    rp.state_indices = state_dst;
    rp.state_index_count = 3;
    rp.state_counts = counts;
    rp.state_count_count = 2;
  }
  REQUIRE(pdlib_receiver_init(r, &rp) == PDLIB_OK);
  REQUIRE(WaitSender(s, PDLIB_POLL_WAITING_FOR_INPUT));
  CHECK(pdlib_sender_decode_prefix(s, &prefix) == PDLIB_OK);
  CHECK(prefix == q->prefix_tokens);
  REQUIRE(pdlib_sender_init(s, q->n, q->src_aux) == PDLIB_OK);
  if (p->setup.families) {
    state_src[0] = mamba_src;
    state_src[1] = swa_src[0];
    state_src[2] = swa_src[1];
  }
  for (at = 0; at < q->n || (q->n == 0 && at == 0);) {
    size_t len = q->chunk == 0 ? q->n - at : (q->n - at < q->chunk ? q->n - at : q->chunk);
    int last = at + len >= q->n;
    int32_t layer;
    pdlib_send_params_init(&sp);
    sp.pages = q->src + at;
    sp.page_count = len;
    sp.is_last_chunk = last;
    if (p->setup.families && last) {
      sp.state_indices = state_src;
      sp.state_index_count = 3;
      sp.state_counts = counts;
      sp.state_count_count = 2;
    }
    if (q->layers) {
      CHECK(pdlib_sender_num_layers(s) == kBuffers || pdlib_sender_num_layers(s) == kLayers);
      for (layer = 1; layer <= pdlib_sender_num_layers(s); ++layer) {
        sp.layers_done = layer;
        REQUIRE(pdlib_sender_send(s, &sp) == PDLIB_OK);
      }
    } else {
      REQUIRE(pdlib_sender_send(s, &sp) == PDLIB_OK);
    }
    at += len;
    if (q->n == 0) break;
  }
  REQUIRE(WaitDone(s, r));
  {
    char reason[512];
    size_t length = 0;
    CHECK(pdlib_receiver_failure(r, reason, sizeof reason, &length) == PDLIB_OK);
    if (length > 0) fprintf(stderr, "  receiver failed: %s\n", reason);
  }
  CHECK(pdlib_receiver_poll(r) == PDLIB_POLL_SUCCESS);
  CHECK(pdlib_sender_poll(s) == PDLIB_POLL_SUCCESS);
  CHECK(pdlib_receiver_pages_reusable(r) == 1);
  for (b = 0; b < kBuffers; ++b) {
    for (k = 0; k < q->n; ++k) {
      CHECK(memcmp(p->decode->kv[b] + (size_t)q->dst[k] * kPage,
                   p->prefill->kv[b] + (size_t)q->src[k] * kPage, kPage) == 0);
    }
  }
  CHECK(memcmp(p->decode->aux + (size_t)q->dst_aux * kAuxRow,
               p->prefill->aux + (size_t)q->src_aux * kAuxRow, kAuxRow) == 0);
  if (p->setup.families) {
    CHECK(memcmp(p->decode->mamba + mamba_dst * kMambaItem,
                 p->prefill->mamba + mamba_src * kMambaItem, kMambaItem) == 0);
    for (k = 0; k < 2; ++k) {
      CHECK(memcmp(p->decode->swa + swa_dst[k] * kSwaItem, p->prefill->swa + swa_src[k] * kSwaItem,
                   kSwaItem) == 0);
    }
  }
  pdlib_sender_destroy(s);
  pdlib_receiver_destroy(r);
}

static void TestLibrary(void) {
  const char* names[16];
  size_t count = 0, i;
  int fake = 0;
  CHECK(pdlib_abi_version() == PDLIB_C_ABI_VERSION);
  CHECK(strchr(pdlib_version(), '.') != NULL);
  CHECK(pdlib_list_backends(names, 16, &count) == PDLIB_OK);
  for (i = 0; i < count && i < 16; ++i) fake |= strcmp(names[i], "fake") == 0;
  CHECK(fake);
  CHECK(pdlib_list_backends(NULL, 0, &count) == PDLIB_OK);
  CHECK(pdlib_list_backends(names, 16, NULL) == PDLIB_INVALID_ARGUMENT);
  CHECK(strcmp(pdlib_status_name(PDLIB_DATA_LOSS), "DATA_LOSS") == 0);
  CHECK(strcmp(pdlib_poll_name(PDLIB_POLL_SUCCESS), "Success") == 0);
}

static void TestPush(const char* backend) {
  Pair p;
  int32_t src[6] = {1, 2, 3, 4, 5, 6}, dst[6] = {10, 3, 7, 12, 0, 15};
  Request q;
  memset(&q, 0, sizeof q);
  REQUIRE(OpenPair(&p, backend, PDLIB_PUSH, 1));
  q.src = src;
  q.dst = dst;
  q.n = 6;
  q.src_aux = 2;
  q.dst_aux = 5;
  q.room = 11;
  Run(&p, &q); /* one chunk */
  q.room = 12;
  q.chunk = 2;
  Run(&p, &q); /* three chunks */
  q.room = 13;
  q.chunk = 4;
  q.layers = 1;
  Run(&p, &q); /* layer by layer, two chunks */
  {
    pdlib_metrics m;
    memset(&m, 0, sizeof m);
    m.struct_size = sizeof m;
    CHECK(pdlib_manager_metrics(p.decode->manager, &m) == PDLIB_OK);
    CHECK(m.rooms_succeeded == 3);
    CHECK(m.live_rooms == 0);
    memset(&m, 0, sizeof m);
    m.struct_size = sizeof m;
    CHECK(pdlib_manager_metrics(p.prefill->manager, &m) == PDLIB_OK);
    CHECK(m.pages_transferred == 18);
  }
  ClosePair(&p);
}

/* State families from an older caller (a smaller struct_size, packed at that stride) work; an
 * element whose size differs from the first's is refused. */
static void TestOlderStructs(void) {
  Pair p;
  int32_t src[2] = {1, 2}, dst[2] = {5, 6};
  Request q;
  pdlib_manager_options o;
  pdlib_state_family fam[2];
  pdlib_manager* m = NULL;
  memset(&q, 0, sizeof q);
  REQUIRE(OpenPair(&p, "fake", PDLIB_PUSH, 2));
  q.src = src;
  q.dst = dst;
  q.n = 2;
  q.src_aux = 1;
  q.dst_aux = 2;
  q.room = 41;
  Run(&p, &q);
  ClosePair(&p);
  pdlib_manager_options_init(&o);
  pdlib_state_family_init(&fam[0]);
  pdlib_state_family_init(&fam[1]);
  fam[1].struct_size = sizeof fam[1] - 4;
  o.state_families = fam;
  o.state_family_count = 2;
  CHECK(pdlib_manager_create(&o, &m) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "state_families[1].struct_size") != NULL);
  CHECK(m == NULL);
}

static void TestPrefixAndPull(void) {
  Pair p;
  /* Decode holds the first 2 pages (8 tokens): prefill sends the 3 after them. */
  int32_t src[3] = {4, 5, 6}, dst[3] = {8, 9, 1};
  Request q;
  memset(&q, 0, sizeof q);
  REQUIRE(OpenPair(&p, "fake", PDLIB_PUSH, 1));
  q.src = src;
  q.dst = dst;
  q.n = 3;
  q.src_aux = 0;
  q.dst_aux = 1;
  q.room = 21;
  q.prefix_tokens = 2 * kPageTokens;
  Run(&p, &q);
  ClosePair(&p);

  REQUIRE(OpenPair(&p, "fake", PDLIB_PULL, 1));
  memset(&q, 0, sizeof q);
  {
    int32_t psrc[4] = {0, 1, 2, 3}, pdst[4] = {4, 5, 6, 7};
    q.src = psrc;
    q.dst = pdst;
    q.n = 4;
    q.src_aux = 3;
    q.dst_aux = 2;
    q.room = 22;
    q.chunk = 2;
    Run(&p, &q);
  }
  ClosePair(&p);
}

static int log_lines = 0;
static void CountLog(void* user, pdlib_log_level level, const char* file, int line,
                     const char* message) {
  (void)level;
  (void)file;
  (void)line;
  (void)message;
  ++*(int*)user;
}

static void TestErrors(void) {
  Pair p;
  pdlib_sender* s = NULL;
  pdlib_receiver* r = NULL;
  pdlib_manager* m = NULL;
  pdlib_manager_options o;
  pdlib_send_params sp;
  pdlib_receive_params rp;
  int32_t bad[1] = {kPages + 3}, good[1] = {1};
  char text[256];
  size_t length = 0;
  unsigned char bigger[sizeof(pdlib_send_params) + 16];

  /* NULLs where a pointer is required: a code and a message naming it, no crash. */
  CHECK(pdlib_manager_create(NULL, &m) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "options is NULL") != NULL);
  pdlib_manager_options_init(&o);
  CHECK(pdlib_manager_create(&o, NULL) == PDLIB_INVALID_ARGUMENT);
  CHECK(pdlib_sender_send(NULL, NULL) == PDLIB_INVALID_ARGUMENT);
  CHECK(pdlib_sender_poll(NULL) == PDLIB_POLL_FAILED);
  CHECK(pdlib_receiver_init(NULL, NULL) == PDLIB_INVALID_ARGUMENT);
  pdlib_sender_destroy(NULL);
  pdlib_receiver_destroy(NULL);
  pdlib_manager_destroy(NULL);
  /* The ABI version, a struct size no header ever had, a bad enum, a NULL list. */
  o.abi_version = PDLIB_C_ABI_VERSION + 1;
  CHECK(pdlib_manager_create(&o, &m) == PDLIB_FAILED_PRECONDITION);
  CHECK(strstr(pdlib_last_error(), "ABI version") != NULL);
  pdlib_manager_options_init(&o);
  o.struct_size = 2;
  CHECK(pdlib_manager_create(&o, &m) == PDLIB_INVALID_ARGUMENT);
  pdlib_manager_options_init(&o);
  o.mode = 7;
  CHECK(pdlib_manager_create(&o, &m) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "mode 7") != NULL);
  pdlib_manager_options_init(&o);
  o.checksum = -1;
  CHECK(pdlib_manager_create(&o, &m) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "checksum -1") != NULL);
  pdlib_manager_options_init(&o);
  o.kv.count = 2;
  CHECK(pdlib_manager_create(&o, &m) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "kv: 2 buffers") != NULL);
  pdlib_manager_options_init(&o);
  o.backend = "no-such-backend";
  CHECK(pdlib_manager_create(&o, &m) != PDLIB_OK);
  CHECK(m == NULL);

  REQUIRE(OpenPair(&p, "fake", PDLIB_PUSH, 0));
  /* A prefill manager cannot make receivers, a room cannot be opened twice. */
  CHECK(pdlib_receiver_create(p.prefill->manager, "127.0.0.1", p.port, 1, -1, &r) != PDLIB_OK);
  CHECK(r == NULL);
  REQUIRE(pdlib_sender_create(p.prefill->manager, 31, &s) == PDLIB_OK);
  {
    pdlib_sender* twice = NULL;
    CHECK(pdlib_sender_create(p.prefill->manager, 31, &twice) == PDLIB_ALREADY_EXISTS);
    CHECK(twice == NULL);
  }
  /* Order: the prefix is not known and nothing can be sent before decode's Init. */
  {
    uint64_t prefix = 0;
    CHECK(pdlib_sender_decode_prefix(s, &prefix) == PDLIB_FAILED_PRECONDITION);
  }
  pdlib_send_params_init(&sp);
  sp.pages = good;
  sp.page_count = 1;
  sp.is_last_chunk = 1;
  CHECK(pdlib_sender_send(s, &sp) == PDLIB_FAILED_PRECONDITION);
  CHECK(strlen(pdlib_last_error()) > 0);
  REQUIRE(pdlib_receiver_create(p.decode->manager, "127.0.0.1", p.port, 31, -1, &r) == PDLIB_OK);
  /* A page index out of the pool: refused with its number, nothing sent. */
  pdlib_receive_params_init(&rp);
  rp.pages = bad;
  rp.page_count = 1;
  rp.aux_index = 0;
  CHECK(pdlib_receiver_init(r, &rp) == PDLIB_INVALID_ARGUMENT ||
        pdlib_receiver_init(r, &rp) == PDLIB_OUT_OF_RANGE);
  CHECK(strstr(pdlib_last_error(), "19") != NULL);
  rp.pages = NULL; /* a NULL list with a count */
  CHECK(pdlib_receiver_init(r, &rp) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "pages is NULL") != NULL);
  /* A newer caller's struct: fine while its extra bytes are zero, refused otherwise. */
  memset(bigger, 0, sizeof bigger);
  memcpy(bigger, &sp, sizeof sp);
  ((pdlib_send_params*)bigger)->struct_size = sizeof bigger;
  bigger[sizeof sp + 3] = 1;
  CHECK(pdlib_sender_send(s, (const pdlib_send_params*)bigger) == PDLIB_INVALID_ARGUMENT);
  CHECK(strstr(pdlib_last_error(), "newer pdlib.h") != NULL);
  /* The real request, then: a bad page to send is refused, a good one goes. */
  rp.pages = good;
  REQUIRE(pdlib_receiver_init(r, &rp) == PDLIB_OK);
  REQUIRE(WaitSender(s, PDLIB_POLL_WAITING_FOR_INPUT));
  REQUIRE(pdlib_sender_init(s, 1, 0) == PDLIB_OK);
  sp.pages = bad;
  CHECK(pdlib_sender_send(s, &sp) != PDLIB_OK);
  bigger[sizeof sp + 3] = 0;
  ((pdlib_send_params*)bigger)->pages = good;
  CHECK(pdlib_sender_send(s, (const pdlib_send_params*)bigger) == PDLIB_OK);
  CHECK(WaitDone(s, r));
  CHECK(pdlib_receiver_poll(r) == PDLIB_POLL_SUCCESS);
  CHECK(pdlib_receiver_failure(r, text, sizeof text, &length) == PDLIB_OK);
  CHECK(length == 0);
  pdlib_sender_destroy(s);
  pdlib_receiver_destroy(r);

  /* Abort: both sides fail with the reason; push pages of a failed request are invalid. */
  REQUIRE(pdlib_sender_create(p.prefill->manager, 32, &s) == PDLIB_OK);
  REQUIRE(pdlib_receiver_create(p.decode->manager, "127.0.0.1", p.port, 32, -1, &r) == PDLIB_OK);
  REQUIRE(pdlib_receiver_init(r, &rp) == PDLIB_OK);
  pdlib_set_log_sink(CountLog, &log_lines); /* the failure is logged (a WARNING per side) */
  pdlib_receiver_abort(r, "the engine gave up");
  pdlib_set_log_sink(NULL, NULL);
  CHECK(log_lines > 0);
  CHECK(pdlib_receiver_poll(r) == PDLIB_POLL_FAILED);
  CHECK(pdlib_receiver_failure(r, text, sizeof text, &length) == PDLIB_ABORTED);
  CHECK(strstr(text, "the engine gave up") != NULL);
  CHECK(pdlib_receiver_failure(r, text, 4, &length) == PDLIB_ABORTED);
  CHECK(strlen(text) == 3 && length > 3); /* truncated, NUL-terminated, full length told */
  {
    int32_t invalid[4];
    size_t count = 0;
    CHECK(pdlib_receiver_invalid_pages(r, invalid, 4, &count) == PDLIB_OK);
    CHECK(count == 1 && invalid[0] == 1);
  }
  pdlib_sender_destroy(s);
  pdlib_receiver_destroy(r);
  {
    uint64_t rooms[8];
    size_t count = 0, total = 0;
    double deadline = Now() + 10;
    while (total == 0 && Now() < deadline) {
      CHECK(pdlib_manager_take_reusable_rooms(p.decode->manager, rooms, 8, &count) == PDLIB_OK);
      total += count;
      if (total == 0) Sleep100us();
    }
    CHECK(total == 1 && rooms[0] == 32);
  }
  {
    size_t n = 0;
    char prom[16];
    CHECK(pdlib_manager_metrics_prometheus(p.decode->manager, prom, sizeof prom, &n) == PDLIB_OK);
    CHECK(n > sizeof prom && strncmp(prom, "# HELP", 6) == 0);
  }
  ClosePair(&p);
}

static void TestBootstrapServer(void) {
  pdlib_bootstrap_server* server = NULL;
  pdlib_bootstrap_server* taken = NULL;
  REQUIRE(pdlib_bootstrap_server_start("127.0.0.1", 0, &server) == PDLIB_OK);
  CHECK(pdlib_bootstrap_server_port(server) != 0);
  /* Its port is taken: UNAVAILABLE, with the reason. */
  CHECK(pdlib_bootstrap_server_start("127.0.0.1", pdlib_bootstrap_server_port(server), &taken) ==
        PDLIB_UNAVAILABLE);
  CHECK(taken == NULL);
  pdlib_bootstrap_server_stop(server);
}

typedef struct Case {
  const char* name;
  void (*fn)(void);
} Case;

static void PushFake(void) { TestPush("fake"); }
static void PushUcx(void) {
  const char* names[16];
  size_t count = 0, i;
  int have = 0;
  pdlib_list_backends(names, 16, &count);
  for (i = 0; i < count && i < 16; ++i) have |= strcmp(names[i], "ucx") == 0;
  if (!have) {
    printf("  skipped: this build has no ucx backend\n");
    return;
  }
  TestPush("ucx");
}

int main(int argc, char** argv) {
  static const Case cases[] = {
      {"library", TestLibrary},
      {"push fake: one chunk, chunks, layer by layer, two state families", PushFake},
      {"push ucx shm: one chunk, chunks, layer by layer, two state families", PushUcx},
      {"decode prefix; pull", TestPrefixAndPull},
      {"structs from an older header: state families at their own stride", TestOlderStructs},
      {"errors: NULLs, ABI and struct sizes, order, bad indices, abort, log sink", TestErrors},
      {"bootstrap server", TestBootstrapServer},
  };
  size_t i;
  int ran = 0;
  for (i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    int before = failures;
    if (argc > 1 && strstr(cases[i].name, argv[1]) == NULL) continue;
    printf("c_api_test: %s\n", cases[i].name);
    fflush(stdout);
    cases[i].fn();
    ++ran;
    printf("  %s\n", failures == before ? "ok" : "FAILED");
  }
  if (ran == 0) {
    fprintf(stderr, "c_api_test: no case matches '%s'\n", argc > 1 ? argv[1] : "");
    return 2;
  }
  printf("c_api_test: %d cases, %d failed checks\n", ran, failures);
  return failures == 0 ? 0 : 1;
}
