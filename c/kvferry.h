/* kvferry's C API: the engine, the KV layer and the metrics behind plain C
 * calls, for bindings (the Python package over ctypes; Rust, Go or Java) and
 * for C programs. libkvferry.so exports these functions and nothing else; it
 * needs only glibc (libibverbs and librdmacm are loaded at run time when
 * present, libcuda.so.1 likewise).
 *
 *   kvferry_engine* e = NULL;
 *   if (kvferry_engine_create(NULL, &e) != KVFERRY_OK) die(kvferry_last_error());
 *   kvferry_register_memory(e, pool, pool_bytes, KVFERRY_ACCESS_WRITE, "");
 *   kvferry_segment peer;
 *   kvferry_open_segment(e, "10.0.0.7:15000", &peer);        // handshake, cached
 *   kvferry_request r = {KVFERRY_OP_WRITE, src, dst_addr, len};
 *   kvferry_batch b;
 *   kvferry_submit(e, peer, &r, 1, 0, &b);
 *   kvferry_batch_status st;
 *   kvferry_wait(e, b, 5000, &st);                            // OK: every byte landed
 *   kvferry_release(e, b);
 *   kvferry_engine_destroy(e);
 *
 * Conventions:
 *   - Every fallible call returns a kvferry_status: KVFERRY_OK (0) or the
 *     code of the failure (the engine's canonical codes, below). The
 *     message of the calling thread's last failure is kvferry_last_error();
 *     a call that succeeds leaves it empty.
 *   - Handles are opaque pointers or 64-bit ids. An engine must outlive the
 *     KV senders and receivers made on it; destroying an engine with
 *     batches running waits for them to drain.
 *   - Strings in are NUL-terminated UTF-8. Bytes out that the library
 *     allocates (notifications, metadata, aux payloads, metrics text) are
 *     freed with kvferry_free.
 *   - Timeouts are milliseconds; 0 means "do not wait".
 *   - Thread-safe: any call from any thread. Calls that wait block only the
 *     calling thread (a binding can release its interpreter lock around
 *     them; the Python package does).
 *
 * Versioning: KVFERRY_C_API_VERSION is the version this header declares;
 * kvferry_api_version() the library's. A library keeps every function of
 * the versions before it, so a program built against version N runs on a
 * library reporting N or more.
 */
#ifndef KVFERRY_C_KVFERRY_H_
#define KVFERRY_C_KVFERRY_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVFERRY_C_API_VERSION 2

/* ------------------------------------------------------------------ codes */

typedef enum kvferry_status {
  KVFERRY_OK = 0,
  KVFERRY_CANCELLED = 1,
  KVFERRY_UNKNOWN = 2,
  KVFERRY_INVALID_ARGUMENT = 3,    /* bad input; nothing was done */
  KVFERRY_DEADLINE_EXCEEDED = 4,   /* a wait ran out of time */
  KVFERRY_NOT_FOUND = 5,           /* no such batch, region, peer key, ... */
  KVFERRY_ALREADY_EXISTS = 6,
  KVFERRY_PERMISSION_DENIED = 7,   /* the peer's region forbids the operation */
  KVFERRY_RESOURCE_EXHAUSTED = 8,  /* a bound was reached */
  KVFERRY_FAILED_PRECONDITION = 9, /* e.g. unregistering memory in use */
  KVFERRY_ABORTED = 10,
  KVFERRY_OUT_OF_RANGE = 11,
  KVFERRY_UNIMPLEMENTED = 12,
  KVFERRY_INTERNAL = 13,
  KVFERRY_UNAVAILABLE = 14,        /* the peer is gone or unreachable */
  KVFERRY_DATA_LOSS = 15,          /* checksums disagree */
  KVFERRY_UNAUTHENTICATED = 16     /* the handshake secret does not match */
} kvferry_status;

/* KVFERRY_C_API_VERSION of the library loaded. */
uint32_t kvferry_api_version(void);
/* The library's release, e.g. "0.3.0". */
const char* kvferry_version(void);
/* The message of this thread's last failed call ("" after a success). The
 * pointer stays valid until this thread's next kvferry call. */
const char* kvferry_last_error(void);
/* A code's name: "INVALID_ARGUMENT", ... */
const char* kvferry_status_name(int status);
/* Frees bytes the library allocated (NULL is fine). */
void kvferry_free(void* p);

/* ---------------------------------------------------------------- options */

/* Engine options, set by name; everything unset is automatic. */
typedef struct kvferry_options kvferry_options;

kvferry_options* kvferry_options_new(void);
void kvferry_options_free(kvferry_options* options);
/* Sets one option from text. KVFERRY_INVALID_ARGUMENT for an unknown key or
 * a value that does not parse (the message says which). Keys:
 *   local_host, bind_host       addresses (see EngineOptions)
 *   port, first_port, last_port handshake port (0: the first free one)
 *   transport                   "auto", "tcp" or "rdma"
 *   devices                     RDMA devices, comma-separated ("" all)
 *   gid_index                   -1: automatic
 *   slice_bytes, links_per_peer, retries
 *   connect_timeout_ms, handshake_timeout_ms, peer_timeout_ms,
 *   idle_segment_timeout_ms
 *   secret                      handshake secret (at least 16 bytes)
 *   metrics_port, metrics_host  Prometheus endpoint (-1: off)        */
int kvferry_options_set(kvferry_options* options, const char* key, const char* value);

/* ----------------------------------------------------------------- engine */

typedef struct kvferry_engine kvferry_engine;

/* Starts an engine (options NULL: all automatic) and stores it in *out. */
int kvferry_engine_create(const kvferry_options* options, kvferry_engine** out);
/* Stops the engine and frees it (NULL is fine). */
void kvferry_engine_destroy(kvferry_engine* engine);
/* "host:port", the name peers open this engine by. Valid while the engine
 * lives, as are the strings below. */
const char* kvferry_engine_address(const kvferry_engine* engine);
/* This engine instance's id (new on every start). */
uint64_t kvferry_engine_id(const kvferry_engine* engine);
/* What creation decided and why: key "host", "host_reason", "bind_host",
 * "transport", "transport_reason" or "devices"; NULL for another key. */
const char* kvferry_engine_detection(const kvferry_engine* engine, const char* key);
/* "host:port" of the Prometheus endpoint, "" when off. */
const char* kvferry_engine_metrics_address(const kvferry_engine* engine);

/* ----------------------------------------------------------------- memory */

/* What peers may do with a registered buffer. */
enum {
  KVFERRY_ACCESS_NONE = 0,
  KVFERRY_ACCESS_READ = 1,
  KVFERRY_ACCESS_WRITE = 2,
  KVFERRY_ACCESS_READ_WRITE = 3
};

/* Registers [addr, addr+length): host memory or CUDA device memory.
 * location: "cpu:N", "cuda:N" or "" (no NIC preference). */
int kvferry_register_memory(kvferry_engine* engine, void* addr, uint64_t length, int access,
                            const char* location);
/* KVFERRY_FAILED_PRECONDITION while transfers use it. */
int kvferry_unregister_memory(kvferry_engine* engine, void* addr);

/* --------------------------------------------------------------- segments */

typedef uint64_t kvferry_segment;

typedef struct kvferry_region {
  uint64_t addr;
  uint64_t length;
  int32_t access; /* KVFERRY_ACCESS_* */
} kvferry_region;

/* Handshakes with the engine at "host:port" (cached: the same peer gives
 * the same segment). */
int kvferry_open_segment(kvferry_engine* engine, const char* peer, kvferry_segment* out);
int kvferry_close_segment(kvferry_engine* engine, kvferry_segment segment);
/* The peer's regions by address: up to `capacity` into out; *count is how
 * many the peer has (call with capacity 0 to size the array). */
int kvferry_segment_regions(kvferry_engine* engine, kvferry_segment segment, kvferry_region* out,
                            size_t capacity, size_t* count);
/* The peer instance the segment talks to, as of its last handshake. */
int kvferry_segment_engine_id(kvferry_engine* engine, kvferry_segment segment, uint64_t* out);

/* -------------------------------------------------------------- transfers */

enum { KVFERRY_OP_WRITE = 0, KVFERRY_OP_READ = 1 };

typedef struct kvferry_request {
  int32_t opcode;  /* KVFERRY_OP_WRITE copies local -> peer, READ the reverse */
  void* local;     /* inside memory registered on this engine */
  uint64_t remote; /* an address in the peer's registered memory */
  uint64_t length;
} kvferry_request;

typedef uint64_t kvferry_batch;

typedef struct kvferry_batch_status {
  uint64_t pending;
  uint64_t succeeded;
  uint64_t failed;
  int32_t first_error;  /* the code of the first failed request, or 0 */
  uint64_t first_failed; /* its index */
} kvferry_batch_status;

/* Posts the requests as one batch; nothing is posted when one is out of
 * bounds (INVALID_ARGUMENT) or forbidden (PERMISSION_DENIED).
 * peer_engine_id: 0, or the peer instance the addresses came from. */
int kvferry_submit(kvferry_engine* engine, kvferry_segment segment,
                   const kvferry_request* requests, size_t count, uint64_t peer_engine_id,
                   kvferry_batch* out);
/* The same with one opcode and three arrays of `count`. */
int kvferry_submit_columns(kvferry_engine* engine, kvferry_segment segment, int opcode,
                           const uint64_t* local, const uint64_t* remote, const uint64_t* lengths,
                           size_t count, uint64_t peer_engine_id, kvferry_batch* out);
/* The batch's state now (kvferry_poll) or once done or after timeout_ms
 * (kvferry_wait). Both return KVFERRY_OK only when every request succeeded;
 * else the first failed request's code ("request I: ..." in the message),
 * or KVFERRY_DEADLINE_EXCEEDED while some are pending (kvferry_poll: while
 * pending it returns KVFERRY_OK with out->pending > 0). */
int kvferry_poll(kvferry_engine* engine, kvferry_batch batch, kvferry_batch_status* out);
int kvferry_wait(kvferry_engine* engine, kvferry_batch batch, int64_t timeout_ms,
                 kvferry_batch_status* out);
/* Forgets a finished batch (FAILED_PRECONDITION while it runs). */
int kvferry_release(kvferry_engine* engine, kvferry_batch batch);
/* Waits up to timeout_ms for the batch and releases it: OK only when every
 * byte landed (else as kvferry_wait). DEADLINE_EXCEEDED when it did not
 * finish in time; the call then returns only once nothing of the batch can
 * land any more (bytes on their way cannot be called back, so it waits for
 * the batch to end, which the engine's failure bounds limit: peer_timeout,
 * the handshake timeout; at most 60 s more), and its message says how long.
  * What a synchronous transfer ends with. */
int kvferry_finish(kvferry_engine* engine, kvferry_batch batch, int64_t timeout_ms,
                   kvferry_batch_status* out);
/* Opens `peer`, submits, and ends with kvferry_finish. */
int kvferry_transfer_sync(kvferry_engine* engine, const char* peer, int opcode,
                          const uint64_t* local, const uint64_t* remote, const uint64_t* lengths,
                          size_t count, int64_t timeout_ms);

/* Stream order (CUDA): the batch is submitted once the work queued on
 * `stream` (a CUstream; NULL: the legacy stream) has finished; with
 * hold_stream the stream's later work waits for the batch. keep_result 0:
 * the outcome is logged, not kept. *out is the id for kvferry_wait_on_stream.
 * FAILED_PRECONDITION without a CUDA driver. */
int kvferry_submit_on_stream(kvferry_engine* engine, kvferry_segment segment, int opcode,
                             const uint64_t* local, const uint64_t* remote,
                             const uint64_t* lengths, size_t count, void* stream,
                             int hold_stream, int64_t timeout_ms, int keep_result, uint64_t* out);
int kvferry_wait_on_stream(kvferry_engine* engine, uint64_t id, int64_t timeout_ms,
                           kvferry_batch_status* out);

/* ------------------------------------------------- prepared transfers (2) */
/* Descriptor lists checked once, and transfers made from index pairs into
 * them, posted again and again (docs/nixl.md; TransferEngine::prepared()).
 * Lists and transfers are 64-bit ids. */
/* A list of `count` entries [addrs[i], +lengths[i]) inside memory
 * registered on this engine (kvferry_prep_local) or advertised by the
 * segment's peer (kvferry_prep_remote). NOT_FOUND names the first entry
 * outside it; an empty list is INVALID_ARGUMENT. */
int kvferry_prep_local(kvferry_engine* engine, const uint64_t* addrs, const uint64_t* lengths,
                       size_t count, uint64_t* out);
int kvferry_prep_remote(kvferry_engine* engine, kvferry_segment segment, const uint64_t* addrs,
                        const uint64_t* lengths, size_t count, uint64_t* out);
/* Transfers made from it stay valid. */
int kvferry_release_list(kvferry_engine* engine, uint64_t list);
/* Its entries, and the stride runs that store them. */
int kvferry_list_size(kvferry_engine* engine, uint64_t list, uint64_t* entries, uint64_t* runs);
/* A transfer of pairs (local_list[local_idx[i]], remote_list[remote_idx[i]]),
 * i < count. notification: NULL for none, else `notification_length` bytes
 * sent to the peer once the data is in place. merge: adjacent pairs become
 * one request. INVALID_ARGUMENT for a count of 0, an index out of range or
 * a pair of unequal lengths. */
int kvferry_make_xfer(kvferry_engine* engine, int opcode, uint64_t local_list,
                      const int64_t* local_idx, uint64_t remote_list, const int64_t* remote_idx,
                      size_t count, const void* notification, size_t notification_length,
                      int merge, uint64_t* out);
enum { KVFERRY_XFER_NOT_POSTED = 0, KVFERRY_XFER_IN_PROGRESS = 1, KVFERRY_XFER_DONE = 2 };
/* Posts it (again); *state: IN_PROGRESS (or an error, which then sticks).
 * ALREADY_EXISTS while its previous post runs. notification: NULL keeps
 * the transfer's; else it replaces it from now on. */
int kvferry_post_xfer(kvferry_engine* engine, uint64_t xfer, const void* notification,
                      size_t notification_length, int32_t* state);
/* Its state into *state; the error of a failed post on every call (sticky)
 * until the next post. */
int kvferry_xfer_state(kvferry_engine* engine, uint64_t xfer, int32_t* state);
typedef struct kvferry_xfer_telemetry {
  int64_t start_us;    /* when it was posted (microseconds, Unix epoch) */
  int64_t post_us;     /* inside the post call */
  int64_t transfer_us; /* from the post to the state call that saw it end */
  uint64_t bytes;
  uint64_t descriptors; /* requests after merging */
} kvferry_xfer_telemetry;
/* The last finished post's figures; FAILED_PRECONDITION before one
 * finished; its error if it failed. */
int kvferry_xfer_telemetry_get(kvferry_engine* engine, uint64_t xfer,
                               kvferry_xfer_telemetry* out);
/* Forgets it; ALREADY_EXISTS while a post runs (it stays). */
int kvferry_release_xfer(kvferry_engine* engine, uint64_t xfer);

/* ---------------------------------------------------------- notifications */

/* Sends `length` bytes to the peer now. peer_engine_id as in submit. */
int kvferry_notify(kvferry_engine* engine, kvferry_segment segment, const void* message,
                   size_t length, uint64_t peer_engine_id);
/* Waits for the batch and sends the message only if every request
 * succeeded (its bytes are in place at the peer). */
int kvferry_notify_after(kvferry_engine* engine, kvferry_batch batch, const void* message,
                         size_t length, int64_t timeout_ms);
/* The oldest notification received, waiting up to timeout_ms for one:
 * *sender is its engine id, *message (kvferry_free) and *length its bytes.
 * KVFERRY_DEADLINE_EXCEEDED when none came. */
int kvferry_next_notification(kvferry_engine* engine, int64_t timeout_ms, uint64_t* sender,
                              char** message, size_t* length);

/* Publishes `value` under `key` for peers; kvferry_fetch_metadata reads a
 * peer's (*value: kvferry_free). NOT_FOUND when the peer has no such key. */
int kvferry_publish_metadata(kvferry_engine* engine, const char* key, const void* value,
                             size_t length);
int kvferry_fetch_metadata(kvferry_engine* engine, kvferry_segment segment, const char* key,
                           char** value, size_t* length);

/* ------------------------------------------------------------ peer health */

/* The engine id answering at "host:port" within timeout_ms (UNAVAILABLE or
 * DEADLINE_EXCEEDED when none answers). */
int kvferry_probe(kvferry_engine* engine, const char* peer, int64_t timeout_ms, uint64_t* out);
/* Fences a peer instance: its links close and nothing it sends lands any
 * more. kvferry_peer_fenced: 1 if fenced, else 0. */
void kvferry_fence_peer(kvferry_engine* engine, uint64_t engine_id);
int kvferry_peer_fenced(const kvferry_engine* engine, uint64_t engine_id);

/* ---------------------------------------------------------------- metrics */

/* The engine's metrics in Prometheus' text format (*text: kvferry_free). */
int kvferry_metrics_text(kvferry_engine* engine, char** text, size_t* length);
/* The same as JSON: {"peers": [{"peer", "requests", "requests_ok",
 * "bytes_written", "bytes_read", "slices", "retries", "reconnects",
 * "errors": {code: n}, "latency_p50_s", "latency_p99_s"}], "nics": [{"name",
 * "slices", "bytes", "errors", "errors_by_code": {code: n}, "retries"}]}. */
int kvferry_metrics_json(kvferry_engine* engine, char** text, size_t* length);

/* ------------------------------------------------------- host information */

/* RDMA discovery of this host as JSON (devices: comma-separated allow-list,
 * "" for all; *json: kvferry_free). */
int kvferry_local_topology(const char* devices, char** json, size_t* length);
/* 1 when a CUDA driver loads (stream-ordered calls work), else 0. */
int kvferry_cuda_available(void);

/* The engine's log goes to stderr, one line per message. Levels: */
enum { KVFERRY_LOG_DEBUG = 0, KVFERRY_LOG_INFO = 1, KVFERRY_LOG_WARNING = 2, KVFERRY_LOG_ERROR = 3 };
/* Messages below `level` are dropped (the default: INFO). */
int kvferry_set_log_level(int level);
/* Writes `message` to the engine's log at `level`, in its format. */
void kvferry_log(int level, const char* message);

/* --------------------------------------------------------------- KV layer */

typedef struct kvferry_kv_layout {
  uint32_t layers;
  int32_t combined_kv; /* 1: one buffer per layer (MLA); 0: K and V */
  uint32_t page_tokens;
  uint64_t bytes_per_token; /* per token in one buffer */
  uint32_t pages;           /* pages in each buffer */
} kvferry_kv_layout;

/* Where a pool's buffers are: buffer b = layer * (combined_kv ? 1 : 2) +
 * (0 K | 1 V). */
typedef struct kvferry_kv_pool kvferry_kv_pool;

/* One contiguous zeroed pool the handle owns (freed with the last user:
 * the pool handle, and senders or receivers made from it). */
int kvferry_kv_pool_allocate(const kvferry_kv_layout* layout, kvferry_kv_pool** out);
/* Buffers the caller owns, one per layer (and K/V): `count` addresses. */
int kvferry_kv_pool_wrap(const kvferry_kv_layout* layout, void* const* buffers, size_t count,
                         kvferry_kv_pool** out);
void kvferry_kv_pool_free(kvferry_kv_pool* pool);
/* Buffer b's address, or NULL when b is out of range. */
void* kvferry_kv_pool_buffer(const kvferry_kv_pool* pool, uint32_t b);

typedef struct kvferry_kv_sender kvferry_kv_sender;

typedef struct kvferry_kv_sender_options {
  int64_t timeout_ms;      /* <= 0: 30 s */
  int32_t checksums;       /* 1: CRC-32C per page, checked by the receiver */
  int64_t tell_timeout_ms; /* <= 0: 4 s */
} kvferry_kv_sender_options;

/* options NULL: the defaults. The pool is registered with the engine. */
int kvferry_kv_sender_create(kvferry_engine* engine, const kvferry_kv_pool* pool,
                             const kvferry_kv_sender_options* options, kvferry_kv_sender** out);
void kvferry_kv_sender_destroy(kvferry_kv_sender* sender);
/* Starts a request to the decode at `peer`: src[i] -> dst[i] for `count`
 * page pairs. Nothing is sent yet; *handle names it. */
int kvferry_kv_sender_begin(kvferry_kv_sender* sender, const char* request_id, const char* peer,
                            const uint32_t* src_pages, const uint32_t* dst_pages, size_t count,
                            uint64_t* handle);
int kvferry_kv_sender_send_layer(kvferry_kv_sender* sender, uint64_t handle, uint32_t layer);
int kvferry_kv_sender_send_all(kvferry_kv_sender* sender, uint64_t handle);
/* Sends what remains, waits for every byte, then tells the decode the
 * request is complete with `aux` (at most 512 KiB). The handle is gone. */
int kvferry_kv_sender_finish(kvferry_kv_sender* sender, uint64_t handle, const void* aux,
                             size_t aux_length);
int kvferry_kv_sender_cancel(kvferry_kv_sender* sender, uint64_t handle, const char* reason);
/* begin + send_all + finish. */
int kvferry_kv_sender_send(kvferry_kv_sender* sender, const char* request_id, const char* peer,
                           const uint32_t* src_pages, const uint32_t* dst_pages, size_t count,
                           const void* aux, size_t aux_length);

typedef struct kvferry_kv_receiver kvferry_kv_receiver;

enum { KVFERRY_KV_PENDING = 0, KVFERRY_KV_COMPLETE = 1, KVFERRY_KV_FAILED = 2 };

/* Registers the pool for remote writes and publishes its layout.
 * peer_timeout_ms <= 0: 4 s. */
int kvferry_kv_receiver_create(kvferry_engine* engine, const kvferry_kv_pool* pool,
                               int64_t peer_timeout_ms, kvferry_kv_receiver** out);
void kvferry_kv_receiver_destroy(kvferry_kv_receiver* receiver);
/* The request is to come from the prefill at "host:port" (instance
 * prefill_engine_id, 0: ask it); if that prefill dies first, it fails. */
int kvferry_kv_receiver_expect(kvferry_kv_receiver* receiver, const char* request_id,
                               const char* prefill, uint64_t prefill_engine_id);
/* The request's state now (poll) or once finished or after timeout_ms
 * (wait). *state is KVFERRY_KV_*; when complete, *aux (kvferry_free) and
 * *aux_length are the sender's payload (NULL and 0 otherwise). Returns OK
 * while pending or complete; a failed request returns its error (state
 * FAILED); wait returns DEADLINE_EXCEEDED when still pending. */
int kvferry_kv_receiver_poll(kvferry_kv_receiver* receiver, const char* request_id, int* state,
                             char** aux, size_t* aux_length);
int kvferry_kv_receiver_wait(kvferry_kv_receiver* receiver, const char* request_id,
                             int64_t timeout_ms, int* state, char** aux, size_t* aux_length);
/* Forgets a finished request, so its id can be used again. */
void kvferry_kv_receiver_forget(kvferry_kv_receiver* receiver, const char* request_id);
/* Requests whose pages did not match the sender's checksums. */
uint64_t kvferry_kv_receiver_checksum_failures(const kvferry_kv_receiver* receiver);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVFERRY_C_KVFERRY_H_ */
