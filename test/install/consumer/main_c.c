/* A C program built against the installed package (pdlib::pdlib_c): one request between a
 * prefill and a decode manager of this process, fake backend, every byte compared. */
#include <pdlib/c/pdlib.h>
#include <stdio.h>
#include <string.h>

static unsigned char kv[2][4][256], aux[2][4][64];

static pdlib_manager* Manager(int side) {
  pdlib_manager_options o;
  pdlib_key_value copy = {"fake.copy", "true"};
  static uint64_t ptrs[2][4], lens[2][4], items[2][4], aux_desc[2][3];
  pdlib_manager* m = NULL;
  int b;
  for (b = 0; b < 4; ++b) {
    ptrs[side][b] = (uint64_t)(uintptr_t)kv[side][b];
    lens[side][b] = sizeof kv[side][b];
    items[side][b] = 64;
  }
  aux_desc[side][0] = (uint64_t)(uintptr_t)aux[side];
  aux_desc[side][1] = sizeof aux[side];
  aux_desc[side][2] = 64;
  pdlib_manager_options_init(&o);
  o.mode = side == 0 ? PDLIB_MODE_PREFILL : PDLIB_MODE_DECODE;
  o.backend_options = &copy;
  o.backend_option_count = 1;
  o.control_plane = PDLIB_CONTROL_IN_PROCESS;
  o.bootstrap_port = 4242;
  o.kv.ptrs = ptrs[side];
  o.kv.lens = lens[side];
  o.kv.item_lens = items[side];
  o.kv.count = 4;
  o.aux.ptrs = &aux_desc[side][0];
  o.aux.lens = &aux_desc[side][1];
  o.aux.item_lens = &aux_desc[side][2];
  o.aux.count = 1;
  o.num_layers = 2;
  o.num_kv_heads = 1;
  o.head_dim = 64;
  o.dtype_bytes = 1;
  if (pdlib_manager_create(&o, &m) != PDLIB_OK) printf("create: %s\n", pdlib_last_error());
  return m;
}

int main(void) {
  pdlib_manager* prefill = Manager(0);
  pdlib_manager* decode = Manager(1);
  pdlib_sender* s = NULL;
  pdlib_receiver* r = NULL;
  pdlib_receive_params rp;
  pdlib_send_params sp;
  int32_t src = 1, dst = 2, b, ok = 1;
  memset(kv[0], 0x5a, sizeof kv[0]);
  if (!prefill || !decode || pdlib_sender_create(prefill, 42, &s) != PDLIB_OK ||
      pdlib_receiver_create(decode, "127.0.0.1", 4242, 42, -1, &r) != PDLIB_OK) {
    printf("consumer_c: %s\n", pdlib_last_error());
    return 1;
  }
  pdlib_receive_params_init(&rp);
  rp.pages = &dst;
  rp.page_count = 1;
  rp.aux_index = 0;
  pdlib_receiver_init(r, &rp);
  while (pdlib_sender_poll(s) < PDLIB_POLL_WAITING_FOR_INPUT && pdlib_sender_poll(s) != 0) {
  }
  pdlib_send_params_init(&sp);
  sp.pages = &src;
  sp.page_count = 1;
  sp.is_last_chunk = 1;
  pdlib_sender_init(s, 1, 0);
  pdlib_sender_send(s, &sp);
  while (pdlib_receiver_poll(r) != PDLIB_POLL_SUCCESS && pdlib_receiver_poll(r) != 0) {
  }
  for (b = 0; b < 4; ++b) ok &= memcmp(kv[1][b] + dst * 64, kv[0][b] + src * 64, 64) == 0;
  if (pdlib_receiver_poll(r) == PDLIB_POLL_SUCCESS && ok) {
    printf("consumer_c: pdlib %s, room 42 Success, bytes identical\n", pdlib_version());
  }
  pdlib_sender_destroy(s);
  pdlib_receiver_destroy(r);
  pdlib_manager_destroy(decode);
  pdlib_manager_destroy(prefill);
  return ok ? 0 : 1;
}
