// pdlib from Go through the C API (include/pdlib/c/pdlib.h) with cgo: a decode process (this
// one) and a prefill process (this program again, started with `prefill PORT`) move one request
// over UCX, and decode checks every byte. The KV pools and every list handed to pdlib live in C
// memory (C.calloc): pdlib keeps using the pools after the calls return, which Go memory must
// not be used for.
//
//	apt-get install golang-go                               # Debian's Go (1.19)
//	cd examples/go/pd_pair
//	CGO_CFLAGS="-I$PWD/../../../include" \
//	CGO_LDFLAGS="-L$PWD/../../../build/release/lib -Wl,-rpath,$PWD/../../../build/release/lib" \
//	  go run .                                                # "pd_pair (go): ... identical"
package main

/*
#cgo LDFLAGS: -lpdlib_c
#include <stdlib.h>
#include "pdlib/c/pdlib.h"
*/
import "C"

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"time"
	"unsafe"
)

const (
	layers    = 4 // K and V of each: 8 buffers
	pages     = 32
	pageBytes = 16 * 2 * 64 // 16 tokens x 2 heads x 64 bytes
	auxRow    = 64
	room      = 0x60
	auxWord   = 0x0123456789abcdef
)

var src = []int32{3, 4, 5, 6, 7}
var dst = []int32{20, 2, 31, 9, 10}

// The byte prefill holds at `offset` of page `page` of buffer `buffer`; decode must get it.
func pattern(buffer, page, offset int) byte {
	return byte(buffer*131 + page*31 + offset*7 + (offset >> 8))
}

func lastError() string { return C.GoString(C.pdlib_last_error()) }

func check(what string, code C.pdlib_status) error {
	if code != C.PDLIB_OK {
		return fmt.Errorf("%s: %s", what, lastError())
	}
	return nil
}

// cArray copies v into C memory (freed by the caller).
func cInt32s(v []int32) *C.int32_t {
	p := (*C.int32_t)(C.calloc(C.size_t(len(v)), 4))
	copy(unsafe.Slice((*int32)(unsafe.Pointer(p)), len(v)), v)
	return p
}

// One side's pools in C memory, and their description.
type pools struct {
	kv      [2 * layers]unsafe.Pointer
	aux     unsafe.Pointer
	desc    *C.uint64_t // ptrs, lens, items of the KV buffers, then ptr, len, item of aux
	buffers []byte      // views, for filling and checking
}

func newPools(fill bool) *pools {
	p := &pools{}
	p.desc = (*C.uint64_t)(C.calloc(3*2*layers+3, 8))
	d := unsafe.Slice((*uint64)(unsafe.Pointer(p.desc)), 3*2*layers+3)
	for b := range p.kv {
		p.kv[b] = C.calloc(pages*pageBytes, 1)
		if fill {
			buf := unsafe.Slice((*byte)(p.kv[b]), pages*pageBytes)
			for i := range buf {
				buf[i] = pattern(b, i/pageBytes, i%pageBytes)
			}
		}
		d[b] = uint64(uintptr(p.kv[b]))
		d[2*layers+b] = pages * pageBytes
		d[4*layers+b] = pageBytes
	}
	p.aux = C.calloc(8*auxRow, 1)
	if fill {
		*(*uint64)(p.aux) = auxWord // row 0
	}
	d[6*layers], d[6*layers+1], d[6*layers+2] = uint64(uintptr(p.aux)), 8*auxRow, auxRow
	return p
}

func (p *pools) free() {
	for _, b := range p.kv {
		C.free(b)
	}
	C.free(p.aux)
	C.free(unsafe.Pointer(p.desc))
}

func manager(mode C.int32_t, p *pools, bootstrapPort uint16) (*C.pdlib_manager, error) {
	tls := os.Getenv("PD_PAIR_UCX_TLS")
	if tls == "" {
		tls = "shm"
	}
	strs := []*C.char{C.CString("ucx"), C.CString("ucx.tls"), C.CString(tls), C.CString("pd-pair-go")}
	defer func() {
		for _, s := range strs {
			C.free(unsafe.Pointer(s))
		}
	}()
	kv := (*C.pdlib_key_value)(C.calloc(1, C.size_t(unsafe.Sizeof(C.pdlib_key_value{}))))
	defer C.free(unsafe.Pointer(kv))
	kv.key, kv.value = strs[1], strs[2]
	var o C.pdlib_manager_options
	C.pdlib_manager_options_init(&o)
	o.mode = mode
	o.backend = strs[0]
	o.backend_options = kv
	o.backend_option_count = 1
	d := unsafe.Slice((*C.uint64_t)(unsafe.Pointer(p.desc)), 3*2*layers+3)
	o.kv = C.pdlib_buffers{ptrs: &d[0], lens: &d[2*layers], item_lens: &d[4*layers], count: 2 * layers}
	o.aux = C.pdlib_buffers{ptrs: &d[6*layers], lens: &d[6*layers+1], item_lens: &d[6*layers+2], count: 1}
	o.page_size = 16
	o.kv_head_num = 2
	o.num_layers = layers
	o.num_kv_heads = 2
	o.head_dim = 64
	o.dtype_bytes = 1
	o.model_name = strs[3]
	o.bootstrap_port = C.uint16_t(bootstrapPort)
	o.checksum = C.PDLIB_CHECKSUM_ALL // the KV digest end to end, both sides
	var m *C.pdlib_manager
	if err := check("pdlib_manager_create", C.pdlib_manager_create(&o, &m)); err != nil {
		return nil, err
	}
	return m, nil
}

func wait(deadline time.Time, done func() bool) bool {
	for !done() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(200 * time.Microsecond)
	}
	return true
}

func senderFailure(s *C.pdlib_sender) string {
	buf := (*C.char)(C.calloc(512, 1))
	defer C.free(unsafe.Pointer(buf))
	var n C.size_t
	C.pdlib_sender_failure(s, buf, 512, &n)
	return C.GoString(buf)
}

func prefill(port uint16) error {
	p := newPools(true)
	defer p.free()
	m, err := manager(C.PDLIB_MODE_PREFILL, p, port)
	if err != nil {
		return err
	}
	defer C.pdlib_manager_destroy(m)
	var s *C.pdlib_sender
	if err := check("pdlib_sender_create", C.pdlib_sender_create(m, room, &s)); err != nil {
		return err
	}
	defer C.pdlib_sender_destroy(s)
	deadline := time.Now().Add(30 * time.Second)
	wait(deadline, func() bool {
		st := C.pdlib_sender_poll(s)
		return st >= C.PDLIB_POLL_WAITING_FOR_INPUT || st == C.PDLIB_POLL_FAILED
	})
	if C.pdlib_sender_poll(s) < C.PDLIB_POLL_WAITING_FOR_INPUT {
		return fmt.Errorf("prefill: the decode side never came: %s", senderFailure(s))
	}
	if err := check("pdlib_sender_init", C.pdlib_sender_init(s, C.uint64_t(len(src)), 0)); err != nil {
		return err
	}
	// Two chunks: the first three pages, then the rest with the metadata row.
	for _, chunk := range [][]int32{src[:3], src[3:]} {
		list := cInt32s(chunk)
		var sp C.pdlib_send_params
		C.pdlib_send_params_init(&sp)
		sp.pages = list
		sp.page_count = C.size_t(len(chunk))
		if len(chunk) == len(src)-3 {
			sp.is_last_chunk = 1
		}
		err := check("pdlib_sender_send", C.pdlib_sender_send(s, &sp))
		C.free(unsafe.Pointer(list))
		if err != nil {
			return err
		}
	}
	wait(deadline, func() bool {
		st := C.pdlib_sender_poll(s)
		return st == C.PDLIB_POLL_SUCCESS || st == C.PDLIB_POLL_FAILED
	})
	if C.pdlib_sender_poll(s) != C.PDLIB_POLL_SUCCESS {
		return fmt.Errorf("prefill: %s", senderFailure(s))
	}
	// A prefill engine outlives its requests: stay up until decode is done (it closes stdin).
	io.Copy(io.Discard, os.Stdin)
	return nil
}

func decode() error {
	host := C.CString("127.0.0.1")
	defer C.free(unsafe.Pointer(host))
	var server *C.pdlib_bootstrap_server
	if err := check("pdlib_bootstrap_server_start", C.pdlib_bootstrap_server_start(host, 0, &server)); err != nil {
		return err
	}
	defer C.pdlib_bootstrap_server_stop(server)
	port := uint16(C.pdlib_bootstrap_server_port(server))
	me, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.Command(me, "prefill", strconv.Itoa(int(port)))
	child.Stdout, child.Stderr = os.Stdout, os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		return err
	}
	if err := child.Start(); err != nil {
		return fmt.Errorf("starting the prefill process: %v", err)
	}
	p := newPools(false)
	defer p.free()
	outcome := func() error {
		m, err := manager(C.PDLIB_MODE_DECODE, p, port)
		if err != nil {
			return err
		}
		defer C.pdlib_manager_destroy(m)
		var r *C.pdlib_receiver
		if err := check("pdlib_receiver_create", C.pdlib_receiver_create(m, host, C.uint16_t(port), room, -1, &r)); err != nil {
			return err
		}
		defer C.pdlib_receiver_destroy(r)
		list := cInt32s(dst)
		defer C.free(unsafe.Pointer(list))
		var rp C.pdlib_receive_params
		C.pdlib_receive_params_init(&rp)
		rp.pages = list
		rp.page_count = C.size_t(len(dst))
		rp.aux_index = 5
		if err := check("pdlib_receiver_init", C.pdlib_receiver_init(r, &rp)); err != nil {
			return err
		}
		wait(time.Now().Add(30*time.Second), func() bool {
			st := C.pdlib_receiver_poll(r)
			return st == C.PDLIB_POLL_SUCCESS || st == C.PDLIB_POLL_FAILED
		})
		if C.pdlib_receiver_poll(r) != C.PDLIB_POLL_SUCCESS {
			buf := (*C.char)(C.calloc(512, 1))
			defer C.free(unsafe.Pointer(buf))
			var n C.size_t
			C.pdlib_receiver_failure(r, buf, 512, &n)
			return fmt.Errorf("decode: the request did not succeed: %s", C.GoString(buf))
		}
		return nil
	}()
	stdin.Close() // the prefill process may go now
	prefillErr := child.Wait()
	if outcome != nil {
		return outcome
	}
	if prefillErr != nil {
		return fmt.Errorf("the prefill process failed: %v", prefillErr)
	}
	// Every byte of every page, and the metadata row.
	wrong := 0
	for b := range p.kv {
		buf := unsafe.Slice((*byte)(p.kv[b]), pages*pageBytes)
		for k, page := range dst {
			for i := 0; i < pageBytes; i++ {
				if buf[int(page)*pageBytes+i] != pattern(b, int(src[k]), i) {
					wrong++
				}
			}
		}
	}
	if *(*uint64)(unsafe.Add(p.aux, 5*auxRow)) != auxWord {
		wrong++
	}
	if wrong > 0 {
		return fmt.Errorf("decode: %d bytes differ from what prefill sent", wrong)
	}
	fmt.Printf("pd_pair (go): pdlib %s from Go: %d pages x %d buffers and the metadata row moved "+
		"between two processes over ucx, every byte identical\n",
		C.GoString(C.pdlib_version()), len(dst), 2*layers)
	return nil
}

func main() {
	var err error
	if len(os.Args) >= 3 && os.Args[1] == "prefill" {
		port, perr := strconv.Atoi(os.Args[2])
		if perr != nil {
			err = fmt.Errorf("bad port %s", os.Args[2])
		} else {
			err = prefill(uint16(port))
		}
	} else {
		err = decode()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "pd_pair:", err)
		os.Exit(1)
	}
}
