// pdlib from Rust through the C API (include/pdlib/c/pdlib.h), with nothing but `std` and an
// `extern "C"` block: a decode process (this one) and a prefill process (this program again,
// started with `prefill`) move one request over UCX, and decode checks every byte.
//
//   rustc --edition 2021 -O -L build/release/lib examples/rust/pd_pair.rs -o pd_pair
//   LD_LIBRARY_PATH=build/release/lib ./pd_pair          # prints "pd_pair: ... identical"
//
// The structs below mirror the header's field for field (#[repr(C)]); each is filled by its
// _init function first, so only the fields set here differ from pdlib's defaults.
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::io::Read;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

#[repr(C)]
struct Buffers {
    ptrs: *const u64,
    lens: *const u64,
    item_lens: *const u64,
    count: usize,
}

#[repr(C)]
struct KeyValue {
    key: *const c_char,
    value: *const c_char,
}

#[repr(C)]
struct ManagerOptions {
    struct_size: usize,
    abi_version: u32,
    mode: c_int,
    backend: *const c_char,
    backend_options: *const KeyValue,
    backend_option_count: usize,
    control_plane: c_int,
    direction: c_int,
    kv: Buffers,
    aux: Buffers,
    state_families: *const c_void,
    state_family_count: usize,
    page_size: u32,
    kv_head_num: i32,
    kv_layout: c_int,
    is_mla: i32,
    prefill_start_layer: i32,
    memory_kind: c_int,
    device_id: i32,
    tp_size: i32,
    tp_rank: i32,
    dp_size: i32,
    dp_rank: i32,
    pp_size: i32,
    pp_rank: i32,
    num_layers: i32,
    num_kv_heads: i32,
    head_dim: i32,
    dtype_bytes: i32,
    layout_version: i32,
    model_name: *const c_char,
    kv_dtype: *const c_char,
    engine_tag: *const c_char,
    listen_host: *const c_char,
    listen_port: u16,
    bootstrap_host: *const c_char,
    bootstrap_port: u16,
    start_bootstrap_server: i32,
    liveness_timeout_ms: u32,
    connect_timeout_ms: u32,
    bootstrap_timeout_ms: u32,
    waiting_timeout_ms: u32,
    transfer_timeout_ms: u32,
    auth_secret: *const c_char,
    checksum: c_int,
    checksum_sample_every: u32,
    transfer_workers: i32,
}

#[repr(C)]
struct SendParams {
    struct_size: usize,
    pages: *const i32,
    page_count: usize,
    is_last_chunk: i32,
    layers_done: i32,
    state_indices: *const i32,
    state_index_count: usize,
    state_counts: *const u32,
    state_count_count: usize,
}

#[repr(C)]
struct ReceiveParams {
    struct_size: usize,
    pages: *const i32,
    page_count: usize,
    aux_index: i64,
    state_indices: *const i32,
    state_index_count: usize,
    state_counts: *const u32,
    state_count_count: usize,
    decode_prefix_len: u64,
    prompt_len: u64,
}

enum Manager {}
enum Sender {}
enum Receiver {}
enum BootstrapServer {}

const MODE_PREFILL: c_int = 0;
const MODE_DECODE: c_int = 1;
const POLL_FAILED: c_int = 0;
const POLL_WAITING_FOR_INPUT: c_int = 2;
const POLL_SUCCESS: c_int = 4;
const CHECKSUM_ALL: c_int = 2;

#[link(name = "pdlib_c")]
extern "C" {
    fn pdlib_version() -> *const c_char;
    fn pdlib_last_error() -> *const c_char;
    fn pdlib_manager_options_init(options: *mut ManagerOptions);
    fn pdlib_manager_create(options: *const ManagerOptions, out: *mut *mut Manager) -> c_int;
    fn pdlib_manager_destroy(manager: *mut Manager);
    fn pdlib_sender_create(manager: *mut Manager, room: u64, out: *mut *mut Sender) -> c_int;
    fn pdlib_sender_destroy(sender: *mut Sender);
    fn pdlib_sender_init(sender: *mut Sender, num_kv_pages: u64, aux_index: i64) -> c_int;
    fn pdlib_send_params_init(params: *mut SendParams);
    fn pdlib_sender_send(sender: *mut Sender, params: *const SendParams) -> c_int;
    fn pdlib_sender_poll(sender: *const Sender) -> c_int;
    fn pdlib_sender_failure(sender: *const Sender, out: *mut c_char, capacity: usize,
                            length: *mut usize) -> c_int;
    fn pdlib_receiver_create(manager: *mut Manager, host: *const c_char, port: u16, room: u64,
                             prefill_dp_rank: i32, out: *mut *mut Receiver) -> c_int;
    fn pdlib_receiver_destroy(receiver: *mut Receiver);
    fn pdlib_receive_params_init(params: *mut ReceiveParams);
    fn pdlib_receiver_init(receiver: *mut Receiver, params: *const ReceiveParams) -> c_int;
    fn pdlib_receiver_poll(receiver: *const Receiver) -> c_int;
    fn pdlib_receiver_failure(receiver: *const Receiver, out: *mut c_char, capacity: usize,
                              length: *mut usize) -> c_int;
    fn pdlib_bootstrap_server_start(host: *const c_char, port: u16,
                                    out: *mut *mut BootstrapServer) -> c_int;
    fn pdlib_bootstrap_server_port(server: *const BootstrapServer) -> u16;
    fn pdlib_bootstrap_server_stop(server: *mut BootstrapServer);
}

const LAYERS: usize = 4; // K and V of each: 8 buffers
const PAGES: usize = 32;
const PAGE_BYTES: usize = 16 * 2 * 64; // 16 tokens x 2 heads x 64 bytes
const AUX_ROW: usize = 64;
const ROOM: u64 = 0x5eed;
const SRC: [i32; 5] = [3, 4, 5, 6, 7];
const DST: [i32; 5] = [20, 2, 31, 9, 10];

fn last_error() -> String {
    unsafe { CStr::from_ptr(pdlib_last_error()).to_string_lossy().into_owned() }
}

fn check(what: &str, code: c_int) -> Result<(), String> {
    if code == 0 { Ok(()) } else { Err(format!("{}: {}", what, last_error())) }
}

// The byte prefill holds at `offset` of page `page` of buffer `buffer`; decode must end up with it.
fn pattern(buffer: usize, page: usize, offset: usize) -> u8 {
    (buffer * 131 + page * 31 + offset * 7 + (offset >> 8)) as u8
}

// One side's pools: K and V of each layer, and the metadata rows.
struct Pools {
    kv: Vec<Vec<u8>>,
    aux: Vec<u8>,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    items: Vec<u64>,
    aux_desc: [u64; 3],
}

impl Pools {
    fn new(fill: bool) -> Pools {
        let mut kv: Vec<Vec<u8>> = (0..2 * LAYERS).map(|_| vec![0u8; PAGES * PAGE_BYTES]).collect();
        if fill {
            for (b, buf) in kv.iter_mut().enumerate() {
                for (i, byte) in buf.iter_mut().enumerate() {
                    *byte = pattern(b, i / PAGE_BYTES, i % PAGE_BYTES);
                }
            }
        }
        let mut aux = vec![0u8; 8 * AUX_ROW];
        if fill {
            aux[..8].copy_from_slice(&0x1234_5678_9abc_def0u64.to_le_bytes()); // row 0
        }
        let ptrs = kv.iter().map(|b| b.as_ptr() as u64).collect();
        let lens = kv.iter().map(|b| b.len() as u64).collect();
        let items = vec![PAGE_BYTES as u64; 2 * LAYERS];
        let aux_desc = [aux.as_ptr() as u64, aux.len() as u64, AUX_ROW as u64];
        Pools { kv, aux, ptrs, lens, items, aux_desc }
    }
}

fn manager(mode: c_int, pools: &Pools, bootstrap_port: u16) -> Result<*mut Manager, String> {
    let backend = CString::new("ucx").unwrap();
    let tls = std::env::var("PD_PAIR_UCX_TLS").unwrap_or_else(|_| "shm".to_string());
    let (k, v) = (CString::new("ucx.tls").unwrap(), CString::new(tls).unwrap());
    let backend_options = [KeyValue { key: k.as_ptr(), value: v.as_ptr() }];
    let model = CString::new("pd-pair-rust").unwrap();
    let mut o: ManagerOptions = unsafe { std::mem::zeroed() };
    unsafe { pdlib_manager_options_init(&mut o) };
    o.mode = mode;
    o.backend = backend.as_ptr();
    o.backend_options = backend_options.as_ptr();
    o.backend_option_count = backend_options.len();
    o.kv = Buffers { ptrs: pools.ptrs.as_ptr(), lens: pools.lens.as_ptr(),
                     item_lens: pools.items.as_ptr(), count: pools.ptrs.len() };
    o.aux = Buffers { ptrs: &pools.aux_desc[0], lens: &pools.aux_desc[1],
                      item_lens: &pools.aux_desc[2], count: 1 };
    o.page_size = 16;
    o.kv_head_num = 2;
    o.num_layers = LAYERS as i32;
    o.num_kv_heads = 2;
    o.head_dim = 64;
    o.dtype_bytes = 1;
    o.model_name = model.as_ptr();
    o.bootstrap_port = bootstrap_port;
    o.checksum = CHECKSUM_ALL; // the KV digest end to end, both sides
    let mut m: *mut Manager = std::ptr::null_mut();
    check("pdlib_manager_create", unsafe { pdlib_manager_create(&o, &mut m) })?;
    Ok(m)
}

fn wait(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

fn prefill(bootstrap_port: u16) -> Result<(), String> {
    let pools = Pools::new(true);
    let m = manager(MODE_PREFILL, &pools, bootstrap_port)?;
    let mut s: *mut Sender = std::ptr::null_mut();
    check("pdlib_sender_create", unsafe { pdlib_sender_create(m, ROOM, &mut s) })?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = wait(deadline, || unsafe { pdlib_sender_poll(s) } >= POLL_WAITING_FOR_INPUT
                     || unsafe { pdlib_sender_poll(s) } == POLL_FAILED);
    let result = if !ready || unsafe { pdlib_sender_poll(s) } == POLL_FAILED {
        Err(format!("prefill: the decode side never came: {}", sender_failure(s)))
    } else {
        check("pdlib_sender_init", unsafe { pdlib_sender_init(s, SRC.len() as u64, 0) })?;
        // Two chunks: the first three pages, then the rest with the metadata row.
        for (chunk, last) in [(&SRC[..3], 0), (&SRC[3..], 1)] {
            let mut p: SendParams = unsafe { std::mem::zeroed() };
            unsafe { pdlib_send_params_init(&mut p) };
            p.pages = chunk.as_ptr();
            p.page_count = chunk.len();
            p.is_last_chunk = last;
            check("pdlib_sender_send", unsafe { pdlib_sender_send(s, &p) })?;
        }
        wait(deadline, || {
            let st = unsafe { pdlib_sender_poll(s) };
            st == POLL_SUCCESS || st == POLL_FAILED
        });
        if unsafe { pdlib_sender_poll(s) } == POLL_SUCCESS { Ok(()) } else {
            Err(format!("prefill: {}", sender_failure(s)))
        }
    };
    // A prefill engine outlives its requests: stay up until decode is done (it closes our stdin).
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    unsafe {
        pdlib_sender_destroy(s);
        pdlib_manager_destroy(m);
    }
    drop(pools);
    result
}

fn sender_failure(s: *const Sender) -> String {
    let mut buf = vec![0 as c_char; 512];
    let mut len = 0usize;
    unsafe { pdlib_sender_failure(s, buf.as_mut_ptr(), buf.len(), &mut len) };
    unsafe { CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned() }
}

fn decode() -> Result<(), String> {
    let mut server: *mut BootstrapServer = std::ptr::null_mut();
    let host = CString::new("127.0.0.1").unwrap();
    check("pdlib_bootstrap_server_start",
          unsafe { pdlib_bootstrap_server_start(host.as_ptr(), 0, &mut server) })?;
    let port = unsafe { pdlib_bootstrap_server_port(server) };
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(me).arg("prefill").arg(port.to_string())
        .stdin(Stdio::piped()).spawn()
        .map_err(|e| format!("starting the prefill process: {}", e))?;
    let pools = Pools::new(false);
    let outcome = (|| -> Result<(), String> {
        let m = manager(MODE_DECODE, &pools, port)?;
        let mut r: *mut Receiver = std::ptr::null_mut();
        let rc = unsafe { pdlib_receiver_create(m, host.as_ptr(), port, ROOM, -1, &mut r) };
        check("pdlib_receiver_create", rc)?;
        let mut p: ReceiveParams = unsafe { std::mem::zeroed() };
        unsafe { pdlib_receive_params_init(&mut p) };
        p.pages = DST.as_ptr();
        p.page_count = DST.len();
        p.aux_index = 5;
        check("pdlib_receiver_init", unsafe { pdlib_receiver_init(r, &p) })?;
        let deadline = Instant::now() + Duration::from_secs(30);
        wait(deadline, || {
            let st = unsafe { pdlib_receiver_poll(r) };
            st == POLL_SUCCESS || st == POLL_FAILED
        });
        let state = unsafe { pdlib_receiver_poll(r) };
        let mut buf = vec![0 as c_char; 512];
        let mut len = 0usize;
        unsafe { pdlib_receiver_failure(r, buf.as_mut_ptr(), buf.len(), &mut len) };
        let reason = unsafe { CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned() };
        unsafe {
            pdlib_receiver_destroy(r);
            pdlib_manager_destroy(m);
        }
        if state != POLL_SUCCESS {
            return Err(format!("decode: the request did not succeed: {}", reason));
        }
        Ok(())
    })();
    drop(child.stdin.take()); // the prefill process may go now
    let prefill_ok = child.wait().map(|s| s.success()).unwrap_or(false);
    unsafe { pdlib_bootstrap_server_stop(server) };
    outcome?;
    if !prefill_ok {
        return Err("the prefill process failed".to_string());
    }
    // Every byte of every page, and the metadata row.
    let mut wrong = 0usize;
    for (b, buf) in pools.kv.iter().enumerate() {
        for (k, &dst) in DST.iter().enumerate() {
            let page = &buf[dst as usize * PAGE_BYTES..(dst as usize + 1) * PAGE_BYTES];
            for (i, &byte) in page.iter().enumerate() {
                if byte != pattern(b, SRC[k] as usize, i) {
                    wrong += 1;
                }
            }
        }
    }
    let row = &pools.aux[5 * AUX_ROW..5 * AUX_ROW + 8];
    if row != 0x1234_5678_9abc_def0u64.to_le_bytes() {
        wrong += 1;
    }
    if wrong > 0 {
        return Err(format!("decode: {} bytes differ from what prefill sent", wrong));
    }
    println!("pd_pair: pdlib {} from Rust: {} pages x {} buffers and the metadata row moved \
              between two processes over ucx, every byte identical",
             unsafe { CStr::from_ptr(pdlib_version()).to_string_lossy() }, DST.len(), 2 * LAYERS);
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let result = if args.len() >= 3 && args[1] == "prefill" {
        match args[2].parse::<u16>() {
            Ok(port) => prefill(port),
            Err(_) => Err(format!("bad port {}", args[2])),
        }
    } else {
        decode()
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd_pair: {}", e);
            ExitCode::FAILURE
        }
    }
}
