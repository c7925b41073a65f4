/* A Llama-shaped decoder stack's decode step in one call: the embedding rows, every layer's
 * kernels in order, and the final norm, with no Python between them.
 *
 * It replays exactly the kernel calls the per-layer Python path makes (same functions, same
 * arguments, same order), so its output is bit-equal to that path's; what it saves is the
 * interpreter, torch's dispatch and allocations between ~300 small kernel calls a step, and
 * the pool's threads stay hot across the gaps that Python left (see pool.h).
 *
 * Per layer, on the step's n rows (workspace names as in the Python plan):
 *
 *     layer 0:  residual = embed[ids];          normed = rmsnorm(residual)
 *     layer i:  normed, residual = rmsnorm(hidden + residual)   (residual updated in place)
 *     qkv = normed . Wqkv (+ bias);  rotary on q and k in place;  K/V stored at loc
 *     attn = paged attention of q over the pool;  hidden = attn . Wo
 *     normed, residual = rmsnorm(hidden + residual);  act = silu(gate) * up of normed . Wgu
 *     hidden = act . Wdown
 *     final:    out, _ = rmsnorm(hidden + residual)
 */
#include <stdint.h>
#include <string.h>

/* the kernels' entry points (elementwise.c, gemm.c, paged_attention.c) */
void kvflow_rmsnorm(const void *x, int64_t x_st, const void *residual, int64_t r_st,
                    void *residual_out, int64_t ro_st, const void *weight, void *out,
                    int64_t o_st, int64_t n, int hidden, float eps, int is_bf16);
void kvflow_rotary(void *q, int64_t q_st, int64_t q_sh, void *k, int64_t k_st, int64_t k_sh,
                   const int64_t *positions, const float *cos_sin, int64_t n, int heads,
                   int kv_heads, int dim, int is_bf16);
void kvflow_store_kv(void *k_buf, void *v_buf, int64_t kv_st, int64_t kv_sh, const void *k,
                     int64_t k_st, int64_t k_sh, const void *v, int64_t v_st, int64_t v_sh,
                     const int64_t *loc, int64_t n, int heads, int dim, int size);
int kvflow_gemm(const void *x, int64_t x_st, const void *packed, const float *bias, int64_t m,
                int64_t n, int64_t k, void *out, int64_t o_st, int silu_mul, int is_bf16);
int kvflow_paged_attention(const void *q, int64_t q_st, int64_t q_sh, const void *k,
                           const void *v, int64_t kv_st, int64_t kv_sh, const int32_t *table,
                           int64_t table_st, const int64_t *rows, const int64_t *visible,
                           void *out, int64_t o_st, int64_t o_sh, int64_t n, int heads,
                           int kv_heads, int dim, float scale, int64_t window,
                           float logit_cap, int is_bf16, int kv_kind, const float *kv_lut,
                           float k_scale, float v_scale);

/* One layer's weights (packed panels, see gemm.c) and KV pool; mirrors DecoderLayer in
 * kvflow/kernels/cpu/decoder_stack.py. */
struct kvf_stack_layer {
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias;              /* NULL, or float32 [qkv columns padded to 16] */
    void *k_buf, *v_buf;                /* [slots, kv_heads, head_dim] */
    int64_t window;                     /* 0: full attention */
};

/* The whole stack, fixed from load to exit (addresses included). */
struct kvf_stack {
    const struct kvf_stack_layer *layers;
    int64_t num_layers;
    const void *embedding;  /* [vocab, hidden] */
    const void *final_norm; /* [hidden] */
    const float *cos_sin;   /* [positions, head_dim] */
    const int32_t *table;   /* req_to_token */
    int64_t table_st, kv_st, kv_sh;
    int hidden, heads, kv_heads, head_dim, intermediate, is_bf16;
    float eps, scale, logit_cap;
};

/* Runs a decode step of n rows (token ids, positions, KV slots loc, table rows and visible
 * lengths as the paged-attention kernel takes them) into out [n, hidden]. work holds
 * kvflow_decoder_stack_work(stack, n) bytes. Returns 0, or -1 when attention could not
 * allocate its work list. */
int kvflow_decoder_stack(const struct kvf_stack *s, int64_t n, const int64_t *ids,
                         const int64_t *positions, const int64_t *loc, const int64_t *rows,
                         const int64_t *visible, void *work, void *out) {
    const int64_t size = s->is_bf16 ? 2 : 4, hidden = s->hidden, dim = s->head_dim;
    const int64_t q_cols = (int64_t)s->heads * dim, kv_cols = (int64_t)s->kv_heads * dim;
    const int64_t qkv_cols = q_cols + 2 * kv_cols;
    char *residual = work, *hid = residual + n * hidden * size, *normed = hid + n * hidden * size;
    char *qkv = normed + n * hidden * size, *attn = qkv + n * qkv_cols * size;
    char *act = attn + n * q_cols * size;
    for (int64_t i = 0; i < n; i++)
        memcpy(residual + i * hidden * size, (const char *)s->embedding + ids[i] * hidden * size,
               (size_t)(hidden * size));
    for (int64_t l = 0; l < s->num_layers; l++) {
        const struct kvf_stack_layer *w = &s->layers[l];
        if (l == 0)
            kvflow_rmsnorm(residual, hidden, NULL, 0, NULL, 0, w->input_norm, normed, hidden, n,
                           s->hidden, s->eps, s->is_bf16);
        else
            kvflow_rmsnorm(hid, hidden, residual, hidden, residual, hidden, w->input_norm,
                           normed, hidden, n, s->hidden, s->eps, s->is_bf16);
        kvflow_gemm(normed, hidden, w->qkv, w->qkv_bias, n, qkv_cols, hidden, qkv, qkv_cols, 0,
                    s->is_bf16);
        char *k = qkv + q_cols * size, *v = k + kv_cols * size;
        kvflow_rotary(qkv, qkv_cols, dim, k, qkv_cols, dim, positions, s->cos_sin, n, s->heads,
                      s->kv_heads, s->head_dim, s->is_bf16);
        kvflow_store_kv(w->k_buf, w->v_buf, s->kv_st, s->kv_sh, k, qkv_cols, dim, v, qkv_cols,
                        dim, loc, n, s->kv_heads, s->head_dim, (int)size);
        if (kvflow_paged_attention(qkv, qkv_cols, dim, w->k_buf, w->v_buf, s->kv_st, s->kv_sh,
                                   s->table, s->table_st, rows, visible, attn, q_cols, dim, n,
                                   s->heads, s->kv_heads, s->head_dim, s->scale, w->window,
                                   s->logit_cap, s->is_bf16, s->is_bf16, NULL, 1.0f, 1.0f))
            return -1;
        kvflow_gemm(attn, q_cols, w->o, NULL, n, hidden, q_cols, hid, hidden, 0, s->is_bf16);
        kvflow_rmsnorm(hid, hidden, residual, hidden, residual, hidden, w->post_norm, normed,
                       hidden, n, s->hidden, s->eps, s->is_bf16);
        kvflow_gemm(normed, hidden, w->gate_up, NULL, n, 2 * (int64_t)s->intermediate, hidden,
                    act, s->intermediate, 1, s->is_bf16);
        kvflow_gemm(act, s->intermediate, w->down, NULL, n, hidden, s->intermediate, hid, hidden,
                    0, s->is_bf16);
    }
    kvflow_rmsnorm(hid, hidden, residual, hidden, residual, hidden, s->final_norm, out, hidden, n,
                   s->hidden, s->eps, s->is_bf16);
    return 0;
}

/* Bytes of workspace a step of n rows needs. */
int64_t kvflow_decoder_stack_work(const struct kvf_stack *s, int64_t n) {
    int64_t q_cols = (int64_t)s->heads * s->head_dim, kv_cols = (int64_t)s->kv_heads * s->head_dim;
    int64_t per_row = 3 * (int64_t)s->hidden + q_cols + 2 * kv_cols + q_cols + s->intermediate;
    return n * per_row * (s->is_bf16 ? 2 : 4);
}
