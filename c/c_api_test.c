/* The C API from a C11 program: two engines in this process over loopback
 * TCP move bytes, notify, probe, report metrics, and run the KV layer; bad
 * input gets a clear error and leaves the engine usable. Prints gtest-style
 * result lines so CI counts its cases. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c/kvferry.h"

static int failures = 0;
static int case_failed = 0;

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, \
              #cond, kvferry_last_error());                                         \
      case_failed = 1;                                                              \
      return;                                                                       \
    }                                                                               \
  } while (0)

#define CHECK_OK(call) CHECK((call) == KVFERRY_OK)

static kvferry_engine* make_engine(void) {
  kvferry_options* o = kvferry_options_new();
  kvferry_engine* e = NULL;
  if (o == NULL) return NULL;
  if (kvferry_options_set(o, "local_host", "127.0.0.1") != KVFERRY_OK ||
      kvferry_options_set(o, "transport", "tcp") != KVFERRY_OK ||
      kvferry_engine_create(o, &e) != KVFERRY_OK) {
    fprintf(stderr, "engine: %s\n", kvferry_last_error());
    e = NULL;
  }
  kvferry_options_free(o);
  return e;
}

static void fill(char* p, size_t n, int seed) {
  size_t i;
  for (i = 0; i < n; ++i) p[i] = (char)(i * 131 + (size_t)seed * 7 + (i >> 9));
}

static void version_and_errors(void) {
  kvferry_options* o = kvferry_options_new();
  CHECK(kvferry_api_version() == KVFERRY_C_API_VERSION);
  CHECK(strlen(kvferry_version()) > 0);
  CHECK(strcmp(kvferry_status_name(KVFERRY_INVALID_ARGUMENT), "INVALID_ARGUMENT") == 0);
  CHECK(o != NULL);
  CHECK(kvferry_options_set(o, "no_such_option", "1") == KVFERRY_INVALID_ARGUMENT);
  CHECK(strstr(kvferry_last_error(), "no_such_option") != NULL);
  CHECK(kvferry_options_set(o, "port", "70000") == KVFERRY_INVALID_ARGUMENT);
  CHECK(strstr(kvferry_last_error(), "port") != NULL);
  CHECK(kvferry_options_set(o, "transport", "carrier-pigeon") == KVFERRY_OK);
  {
    kvferry_engine* e = (kvferry_engine*)1;
    CHECK(kvferry_engine_create(o, &e) == KVFERRY_INVALID_ARGUMENT);
    CHECK(e == NULL);
    CHECK(strstr(kvferry_last_error(), "carrier-pigeon") != NULL);
  }
  CHECK_OK(kvferry_options_set(o, "port", "0"));
  CHECK(kvferry_last_error()[0] == '\0'); /* a success clears it */
  kvferry_options_free(o);
}

static void write_read_notify(void) {
  enum { kBytes = 1 << 20 };
  kvferry_engine* a = make_engine();
  kvferry_engine* b = make_engine();
  char* src = malloc(kBytes);
  char* dst = calloc(1, kBytes);
  char* back = calloc(1, kBytes);
  kvferry_segment seg = 0;
  kvferry_batch batch = 0;
  kvferry_batch_status st;
  kvferry_region regions[4];
  size_t nregions = 0;
  uint64_t id = 0, sender = 0;
  char* msg = NULL;
  size_t len = 0;
  CHECK(a != NULL && b != NULL && src != NULL && dst != NULL && back != NULL);
  CHECK(strcmp(kvferry_engine_detection(a, "transport"), "tcp") == 0);
  CHECK(kvferry_engine_detection(a, "bogus") == NULL);
  fill(src, kBytes, 3);
  CHECK_OK(kvferry_register_memory(a, src, kBytes, KVFERRY_ACCESS_NONE, ""));
  CHECK_OK(kvferry_register_memory(a, back, kBytes, KVFERRY_ACCESS_NONE, ""));
  CHECK_OK(kvferry_register_memory(b, dst, kBytes, KVFERRY_ACCESS_READ_WRITE, ""));
  CHECK(kvferry_register_memory(b, dst, 10, KVFERRY_ACCESS_WRITE, "") == KVFERRY_INVALID_ARGUMENT);
  CHECK(kvferry_register_memory(b, dst, 10, 9, "") == KVFERRY_INVALID_ARGUMENT);
  CHECK_OK(kvferry_open_segment(a, kvferry_engine_address(b), &seg));
  CHECK_OK(kvferry_segment_regions(a, seg, regions, 4, &nregions));
  CHECK(nregions == 1 && regions[0].addr == (uint64_t)(uintptr_t)dst &&
        regions[0].length == kBytes && regions[0].access == KVFERRY_ACCESS_READ_WRITE);
  CHECK_OK(kvferry_segment_engine_id(a, seg, &id));
  CHECK(id == kvferry_engine_id(b));

  {
    /* Two requests as structs: both halves land. */
    kvferry_request r[2];
    r[0].opcode = KVFERRY_OP_WRITE;
    r[0].local = src;
    r[0].remote = (uint64_t)(uintptr_t)dst;
    r[0].length = kBytes / 2;
    r[1] = r[0];
    r[1].local = src + kBytes / 2;
    r[1].remote += kBytes / 2;
    CHECK_OK(kvferry_submit(a, seg, r, 2, 0, &batch));
    CHECK_OK(kvferry_wait(a, batch, 10000, &st));
    CHECK(st.pending == 0 && st.succeeded == 2 && st.failed == 0);
    CHECK_OK(kvferry_release(a, batch));
    CHECK(memcmp(src, dst, kBytes) == 0);
  }
  {
    /* Out of the peer's bounds: refused before anything is posted, and the
     * engine is still usable afterwards. */
    kvferry_request bad;
    bad.opcode = KVFERRY_OP_WRITE;
    bad.local = src;
    bad.remote = (uint64_t)(uintptr_t)dst + kBytes - 8;
    bad.length = 64;
    CHECK(kvferry_submit(a, seg, &bad, 1, 0, &batch) == KVFERRY_INVALID_ARGUMENT);
    CHECK(strlen(kvferry_last_error()) > 0);
    bad.opcode = 7;
    CHECK(kvferry_submit(a, seg, &bad, 1, 0, &batch) == KVFERRY_INVALID_ARGUMENT);
  }
  {
    /* Columns: read it back into another buffer, then a sync write. */
    uint64_t local = (uint64_t)(uintptr_t)back, remote = (uint64_t)(uintptr_t)dst, n = kBytes;
    CHECK_OK(kvferry_submit_columns(a, seg, KVFERRY_OP_READ, &local, &remote, &n, 1, 0, &batch));
    CHECK_OK(kvferry_wait(a, batch, 10000, &st));
    CHECK_OK(kvferry_release(a, batch));
    CHECK(memcmp(back, src, kBytes) == 0);
    fill(src, kBytes, 9);
    local = (uint64_t)(uintptr_t)src;
    CHECK_OK(kvferry_transfer_sync(a, kvferry_engine_address(b), KVFERRY_OP_WRITE, &local, &remote,
                                   &n, 1, 10000));
    CHECK(memcmp(src, dst, kBytes) == 0);
    CHECK(kvferry_wait(a, 987654321, 10, &st) == KVFERRY_NOT_FOUND);
  }
  {
    /* A notification after a batch, carrying a NUL byte. */
    static const char note[] = "done\0x";
    uint64_t local = (uint64_t)(uintptr_t)src, remote = (uint64_t)(uintptr_t)dst, n = 4096;
    CHECK(kvferry_next_notification(b, 0, &sender, &msg, &len) == KVFERRY_DEADLINE_EXCEEDED);
    CHECK_OK(kvferry_submit_columns(a, seg, KVFERRY_OP_WRITE, &local, &remote, &n, 1, 0, &batch));
    CHECK_OK(kvferry_notify_after(a, batch, note, sizeof(note), 10000));
    CHECK_OK(kvferry_next_notification(b, 10000, &sender, &msg, &len));
    CHECK(sender == kvferry_engine_id(a));
    CHECK(len == sizeof(note) && memcmp(msg, note, len) == 0);
    kvferry_free(msg);
    CHECK_OK(kvferry_release(a, batch));
  }
  {
    char* value = NULL;
    CHECK_OK(kvferry_publish_metadata(b, "model", "llama", 5));
    CHECK_OK(kvferry_fetch_metadata(a, seg, "model", &value, &len));
    CHECK(len == 5 && memcmp(value, "llama", 5) == 0);
    kvferry_free(value);
    CHECK(kvferry_fetch_metadata(a, seg, "absent", &value, &len) == KVFERRY_NOT_FOUND);
  }
  CHECK_OK(kvferry_probe(a, kvferry_engine_address(b), 5000, &id));
  CHECK(id == kvferry_engine_id(b));
  CHECK(kvferry_peer_fenced(b, kvferry_engine_id(a)) == 0);
  {
    char* text = NULL;
    CHECK_OK(kvferry_metrics_text(a, &text, &len));
    CHECK(strstr(text, "kvferry_") != NULL && strlen(text) == len);
    kvferry_free(text);
    CHECK_OK(kvferry_metrics_json(a, &text, &len));
    CHECK(strncmp(text, "{\"peers\": [{\"peer\": ", 20) == 0);
    kvferry_free(text);
  }
  CHECK(kvferry_unregister_memory(b, src) == KVFERRY_NOT_FOUND);
  CHECK_OK(kvferry_close_segment(a, seg));
  kvferry_engine_destroy(a);
  kvferry_engine_destroy(b);
  free(src);
  free(dst);
  free(back);
}

static void kv_layer(void) {
  kvferry_engine* prefill = make_engine();
  kvferry_engine* decode = make_engine();
  kvferry_kv_layout layout;
  kvferry_kv_pool* src_pool = NULL;
  kvferry_kv_pool* dst_pool = NULL;
  kvferry_kv_sender* sender = NULL;
  kvferry_kv_receiver* receiver = NULL;
  uint32_t src_pages[3] = {0, 1, 5};
  uint32_t dst_pages[3] = {2, 3, 7};
  uint64_t handle = 0;
  int state = -1;
  char* aux = NULL;
  size_t aux_len = 0;
  uint32_t b;
  CHECK(prefill != NULL && decode != NULL);
  memset(&layout, 0, sizeof(layout));
  layout.layers = 2;
  layout.page_tokens = 4;
  layout.bytes_per_token = 256;
  layout.pages = 8;
  CHECK_OK(kvferry_kv_pool_allocate(&layout, &src_pool));
  CHECK_OK(kvferry_kv_pool_allocate(&layout, &dst_pool));
  CHECK(kvferry_kv_pool_buffer(src_pool, 4) == NULL); /* 2 layers x K, V */
  for (b = 0; b < 4; ++b) fill(kvferry_kv_pool_buffer(src_pool, b), 8 * 1024, (int)b);
  CHECK_OK(kvferry_kv_receiver_create(decode, dst_pool, 0, &receiver));
  CHECK_OK(kvferry_kv_sender_create(prefill, src_pool, NULL, &sender));
  kvferry_kv_pool_free(src_pool); /* the sender keeps the pool alive */
  CHECK_OK(kvferry_kv_receiver_poll(receiver, "req-1", &state, &aux, &aux_len));
  CHECK(state == KVFERRY_KV_PENDING && aux == NULL);
  CHECK_OK(kvferry_kv_sender_begin(sender, "req-1", kvferry_engine_address(decode), src_pages,
                                   dst_pages, 3, &handle));
  CHECK_OK(kvferry_kv_sender_send_layer(sender, handle, 0));
  CHECK(kvferry_kv_sender_send_layer(sender, handle, 5) == KVFERRY_INVALID_ARGUMENT);
  CHECK_OK(kvferry_kv_sender_finish(sender, handle, "aux!", 4));
  CHECK_OK(kvferry_kv_receiver_wait(receiver, "req-1", 10000, &state, &aux, &aux_len));
  CHECK(state == KVFERRY_KV_COMPLETE && aux_len == 4 && memcmp(aux, "aux!", 4) == 0);
  kvferry_free(aux);
  for (b = 0; b < 4; ++b) {
    /* Pages 0, 1 and 5 of every buffer went to pages 2, 3 and 7. */
    static char expect[8 * 1024];
    const char* got = (const char*)kvferry_kv_pool_buffer(dst_pool, b);
    fill(expect, sizeof(expect), (int)b);
    CHECK(memcmp(got + 2 * 1024, expect, 2 * 1024) == 0);
    CHECK(memcmp(got + 7 * 1024, expect + 5 * 1024, 1024) == 0);
    CHECK(got[0] == 0 && got[4 * 1024] == 0); /* untouched pages stay zero */
  }
  /* A page out of range: refused, the decode is told it will not come. */
  src_pages[0] = 99;
  CHECK(kvferry_kv_sender_begin(sender, "req-2", kvferry_engine_address(decode), src_pages,
                                dst_pages, 3, &handle) == KVFERRY_INVALID_ARGUMENT);
  CHECK(kvferry_kv_receiver_wait(receiver, "req-2", 10000, &state, &aux, &aux_len) != KVFERRY_OK);
  CHECK(state == KVFERRY_KV_FAILED);
  kvferry_kv_receiver_forget(receiver, "req-1");
  CHECK(kvferry_kv_receiver_checksum_failures(receiver) == 0);
  kvferry_kv_sender_destroy(sender);
  kvferry_kv_receiver_destroy(receiver);
  kvferry_kv_pool_free(dst_pool);
  kvferry_engine_destroy(prefill);
  kvferry_engine_destroy(decode);
}

static void run(const char* name, void (*fn)(void)) {
  case_failed = 0;
  printf("[ RUN      ] CApi.%s\n", name);
  fflush(stdout);
  fn();
  if (case_failed) {
    ++failures;
    printf("[  FAILED  ] CApi.%s (0 ms)\n", name);
  } else {
    printf("[       OK ] CApi.%s (0 ms)\n", name);
  }
  fflush(stdout);
}

int main(void) {
  kvferry_set_log_level(KVFERRY_LOG_WARNING);
  run("VersionAndErrors", version_and_errors);
  run("WriteReadNotify", write_read_notify);
  run("KvLayer", kv_layer);
  printf(failures == 0 ? "[  PASSED  ] 3 tests.\n" : "[  FAILED  ] %d tests.\n", failures);
  return failures == 0 ? 0 : 1;
}
