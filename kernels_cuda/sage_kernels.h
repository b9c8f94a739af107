/* sage_patch compiled kernels: plain C ABI (no libtorch), loaded from Python with ctypes.
 *
 * One call, sage_attn_fwd(), runs a whole "8b" or "4b" attention (optionally smooth-V, optionally packed varlen)
 * on the caller's stream:
 *   1. stats pass: per (batch, kv-head) partial sums of K (for the mean) and partial |V| maxima (smooth V: sum,
 *      max and min of V), reduced once per head;
 *   2. quantization passes: Q -> INT8 / INT4 values (per-thread groups Grouping(32, 8, 1); "4b": minus the mean of
 *      its 128-row block), K - mean(K) -> INT8 / INT4 (Grouping(64, 8, 2)), V (- mean(V)) -> FP8 E4M3 per channel,
 *      transposed per 64-key block in the key order the P~V fragments need; "4b": Delta S = mean(Q block).K'^T;
 *   3. attention: INT8 mma.sync QK^T (or INT4 m16n8k64), fp32 online softmax (exp2), P~ -> FP8 E4M3 (x448),
 *      FP8 mma.sync P~V with two-level accumulation (or FP16 P~V on sm_80/86).
 * Everything is launched on `stream`; nothing synchronizes the host. Inputs are only read.
 * Returns 0 or a cudaError_t value (see sage_error_string) or a negative SAGE_E* code.
 */
#ifndef SAGE_KERNELS_H
#define SAGE_KERNELS_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SAGE_ABI_VERSION 9

/* The compiled kernel variants (SageAttnParams.kernel): one id per attention kernel family, chosen by the caller
 * (sage_patch.kernels.registry); nothing here re-derives it. QK4 = "4b" with packed INT4 mma.sync m16n8k64 s4
 * (sm_80/86/89); the others run "4b" as INT4 values in INT8 mma.sync m16n8k32. */
enum {
    SAGE_KERNEL_MMA_FP8 = 0,         /* mma.sync: INT8 Q K^T, FP8 e4m3 P~V mma.sync m16n8k32 (sm_89+) */
    SAGE_KERNEL_MMA_FP16 = 1,        /* mma.sync: INT8 Q K^T, FP16 P~V m16n8k16 (SageAttention1-style, sm_80+) */
    SAGE_KERNEL_MMA_FP8F16 = 2,      /* mma.sync: e4m3 P~ and V values carried in fp16 m16n8k16 (sm_89+; sm_90) */
    SAGE_KERNEL_WGMMA_FP8 = 3,       /* sm_90a: INT8 + FP8 wgmma, warp-specialized, 128-key blocks ("8b" only) */
    SAGE_KERNEL_MMA_FP8_QK4 = 4,     /* as MMA_FP8, "4b" on packed INT4 MMA */
    SAGE_KERNEL_MMA_FP16_QK4 = 5,    /* as MMA_FP16, "4b" on packed INT4 MMA */
    SAGE_KERNEL_MMA_FP8F16_QK4 = 6,  /* as MMA_FP8F16, "4b" on packed INT4 MMA */
    SAGE_KERNEL_COUNT = 7
};

enum { SAGE_E_BADARG = -1, SAGE_E_ARCH = -2, SAGE_E_HEADDIM = -3 };

typedef struct {
    /* inputs, fp16 or bf16, innermost (head-dim) stride 1; strides in elements */
    const void* q; int64_t q_sb, q_sh, q_ss;
    const void* k; int64_t k_sb, k_sh, k_ss;
    const void* v; int64_t v_sb, v_sh, v_ss;
    /* output, same dtype as inputs, head-dim stride 1 */
    void* o; int64_t o_sb, o_sh, o_ss;
    float* lse;                /* (B, Hq, Sq) contiguous fp32 natural log of the TRUE scores (the K-smoothing
                                  shift sm_scale * q.mean(K) is added back), -inf on empty rows; or NULL */
    const uint8_t* kmask;      /* (B, Skv) bool (1 = attend) with batch stride kmask_sb, or NULL */
    int64_t kmask_sb;
    void* workspace;           /* sage_attn_workspace_bytes() bytes, 256-byte aligned */
    int32_t B, Hq, Hkv, Sq, Skv, D;
    int32_t causal;            /* bottom-right aligned: query i sees keys j <= i + Skv - Sq */
    int32_t dtype;             /* 0 = fp16, 1 = bf16 */
    int32_t kernel;            /* ABI 6: the kernel variant, SAGE_KERNEL_* (the QK4 ids need qk_bits 4; WGMMA_FP8
                                  needs qk_bits 8, an sm_90a build and a 9.0 device) */
    int32_t device;            /* CUDA device index of the tensors and of the stream */
    int32_t device_cc;         /* compute capability of the current device, e.g. 90 (cached by the caller) */
    float sm_scale;
    /* ABI 4 */
    int32_t qk_bits;           /* 8 (or 0): INT8 Q/K ("8b"); 4: "4b" = INT4 values in [-7, 7] (carried in INT8 MMA) with
                                  Q smoothing per 128-row CTA block and its Delta S correction (fp32 pre-pass) */
    int32_t smooth_v;          /* 1: V - mean_tokens(V) per channel before quantization, the mean added back to O on
                                  rows with a visible key */
    const int32_t* cu_seqlens_q;  /* variable length (packed) batches: (B+1) int32 token offsets into q/o, and into */
    const int32_t* cu_seqlens_k;  /* k/v; both or neither. Then Sq/Skv are the MAX lengths (>= every sequence's),
                                  q/k/v/o batch strides are ignored, kmask must be NULL and lse is (Hq, lse_sh) */
    int32_t qk_packed;         /* ABI 6: written by the library from `kernel` (1 for the *_QK4 ids, the pre-passes then
                                  pack INT4 rows); callers leave it 0 */
    int32_t hop_split_max;     /* ABI 6, WGMMA_FP8 only: most key-parts a tail tile is split into (1: none; 0: the
                                  default, 4; at most 4); the workspace size depends on it */
    int64_t lse_sh;            /* varlen: lse elements between two heads (total_q); tokens past cu_seqlens_q[B] are
                                  not written */
    int32_t window_keys;       /* ABI 7: sliding window, 0 = none (a zeroed struct has none); n > 0: query i sees no
                                  key j <= i + Skv - Sq - n, i.e. with causal the n keys ending at its diagonal
                                  (FlashAttention's window_size (n - 1, 0), transformers' sliding_window n); key
                                  blocks wholly outside the window are neither loaded nor computed */
} SageAttnParams;

/* ABI 8: the SageBwd training backward (dQ, dK, dV) on sm_90a (kernels_cuda/hopper/bwd_kernel.cuh), from the
 * operands sage_patch.kernels.sagebwd prepares (its numerics: SageBwdConfig(**KERNEL_LAYOUT)). dQ is accumulated
 * with floating-point bulk reductions into dq_acc: by default in whatever order the key blocks reach a query tile
 * (it varies from run to run); with dq_sem (ABI 9) in a fixed order (deterministic). */
typedef struct {
    const int8_t* q_int;       /* Q^ (B, Hq, Sq, D) contiguous */
    const int8_t* q_t;         /* Q^ transposed, (B * Hq, D, t_stride) */
    const int8_t* do_t;        /* dO^ (INT8 per token) transposed, (B * Hq, D, t_stride) */
    const float* stats;        /* (B * Hq, Sq, 4): Q scale, LSE of the smoothed scores in log2 (0 on empty rows),
                                  Delta = rowsum(dO o O), dO scale */
    const int8_t* k_int;       /* K^ (smoothed) (B, Hkv, Skv, D) contiguous */
    const float* k_scale;      /* (B, Hkv, Skv) contiguous */
    const void* v; int64_t v_sb, v_sh, v_ss;        /* (B, Hkv, Skv, D), input dtype; rows 16-byte aligned */
    const void* dout; int64_t do_sb, do_sh, do_ss;  /* (B, Hq, Sq, D), input dtype; rows 16-byte aligned */
    void* dk; void* dv;        /* outputs (B, Hkv, Skv, D) contiguous, input dtype */
    float* dq_acc;             /* (B, Hq, Sq, D) fp32 contiguous, zeroed by the caller: receives dQ / sm_scale */
    const uint8_t* kmask;      /* (B, Skv) bool (1 = attend) with batch stride kmask_sb, or NULL */
    int64_t kmask_sb;
    int64_t t_stride;          /* row length of q_t / do_t in bytes: >= Sq, a multiple of 16 */
    int32_t B, Hq, Hkv, Sq, Skv, D;
    int32_t causal;            /* bottom-right aligned */
    int32_t dtype;             /* 0 = fp16, 1 = bf16 */
    int32_t device, device_cc;
    float sm_scale;
    /* ABI 9 */
    int32_t* dq_sem;           /* NULL: dQ's reductions in any order. Else the deterministic mode: (B, Hq,
                                  ceil(Sq / 64)) int32 contiguous, zeroed by the caller (one counter per 64-query
                                  tile: the key blocks add to a tile one after another, in a fixed order) */
} SageBwdParams;

/* ABI 9: the SageBwd training forward on sm_90a (kernels_cuda/hopper/fwd_train_kernel.cuh): O, the caller's LSE and
 * the smoothed scores' LSE from the operands sage_patch.kernels.sagebwd prepares (Q^, K^ INT8 per token, K smoothed
 * by its mean), the numerics of its Triton forward (SageBwdConfig(**KERNEL_LAYOUT)). */
typedef struct {
    const int8_t* q_int;       /* Q^ (B, Hq, Sq, D) contiguous */
    const float* q_scale;      /* (B, Hq, Sq) contiguous */
    const float* qdot;         /* (B, Hq, Sq) contiguous: q . mean(K) (lse = lse_s + sm_scale qdot), or NULL: lse = lse_s */
    const int8_t* k_int;       /* K^ (smoothed) (B, Hkv, Skv, D) contiguous */
    const float* k_scale;      /* (B, Hkv, Skv) contiguous */
    const void* v; int64_t v_sb, v_sh, v_ss;  /* (B, Hkv, Skv, D), input dtype, channel stride 1; rows 16-byte aligned */
    void* o; int64_t o_sb, o_sh, o_ss;        /* output (B, Hq, Sq, D), input dtype, channel stride 1, 4-byte aligned rows */
    float* lse;                /* (B, Hq, Sq) contiguous, natural log: of the true scores (qdot added back) */
    float* lse_s;              /* (B, Hq, Sq) contiguous, natural log: of the smoothed scores; -inf on empty rows */
    const uint8_t* kmask;      /* (B, Skv) bool (1 = attend) with batch stride kmask_sb, or NULL; read in 16-byte
                                  chunks: 16-byte aligned, kmask_sb a multiple of 16 (or 0), rows readable up to Skv
                                  rounded up to 16 (the bytes past Skv are ignored) */
    int64_t kmask_sb;
    int32_t B, Hq, Hkv, Sq, Skv, D;
    int32_t causal;            /* bottom-right aligned */
    int32_t dtype;             /* 0 = fp16, 1 = bf16 */
    int32_t device, device_cc;
    float sm_scale;
} SageTrainFwdParams;

int64_t sage_attn_workspace_bytes(const SageAttnParams* p);
int sage_attn_fwd(const SageAttnParams* p, void* stream);
const char* sage_error_string(int code);
int sage_abi_version(void);
/* space-separated list of the SASS targets compiled in, e.g. "80 86 89 90a" */
const char* sage_compiled_archs(void);
/* 1 when the sm_90a Hopper kernel (SAGE_KERNEL_WGMMA_FP8) is compiled in */
int sage_hopper_compiled(void);
/* ABI 8: the SageBwd backward (SageBwdParams) on `stream`; 0 or an error code as sage_attn_fwd.
 * Needs an sm_90a build and a 9.0 device, D 64 or 128. */
int sage_bwd(const SageBwdParams* p, void* stream);
/* ABI 9: the SageBwd training forward (SageTrainFwdParams) on `stream`; 0 or an error code as sage_attn_fwd.
 * Needs an sm_90a build and a 9.0 device, D 64 or 128. */
int sage_train_fwd(const SageTrainFwdParams* p, void* stream);

#ifdef __cplusplus
}
#endif
#endif
