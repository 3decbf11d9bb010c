/* moe: the op table and the generic way to call an op.
 *
 * An op is called by name with named tensors and parameters, exactly as a
 * KServe request carries them:
 *
 *   moe_call *c;
 *   moe_op_prepare(moe_op_find("quant.mx"), in, n_in, &params, NULL, &c, &err);
 *   for (i < moe_call_num_outputs(c)) allocate moe_call_output(c, i)->tensor
 *   moe_call_run(c, backend, &err);
 *   moe_call_destroy(c);
 *
 * prepare validates everything (dtype, rank, shapes, byte sizes, parameter
 * values) before any work and names the offending field in err; it computes
 * the output shapes. run only computes. prepare reads the few small inputs
 * whose values must be checked (static scales, topk ids), so call it on host
 * data, then rebind inputs to device copies (moe_call_input) before running. */
#ifndef MOE_OPS_H
#define MOE_OPS_H

#include <stdbool.h>
#include <stddef.h>

#include "moe/params.h"
#include "moe/status.h"
#include "moe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_named_tensor {
  const char *name;
  moe_tensor tensor;
} moe_named_tensor;

typedef struct moe_op moe_op;
typedef struct moe_call moe_call;
typedef struct moe_backend moe_backend;
typedef struct moe_expert_set moe_expert_set;

/* NULL when no op has that name. Expert-set models are called through the
 * op that moe_op_for_expert_sets returns, with the set passed to
 * moe_op_prepare. */
const moe_op *moe_op_find(const char *name);
/* Iteration over the table (built-ins in a fixed order). */
size_t moe_op_count(void);
const moe_op *moe_op_at(size_t i);
const char *moe_op_name(const moe_op *op);

/* Flags of an input or output (moe_op_io_desc.flags): what a caller such as
 * the server must know about it beyond its name and dtypes, so that it asks
 * the table instead of matching op or input names. */
enum {
  /* An expert weight tensor (w13, w2, their scales and zero points; not the
   * routing's correction_bias). An expert set passed to moe_op_prepare
   * holds these, so a set's model neither takes nor advertises them;
   * without a set they are request inputs, the same for many requests and
   * large, which is why the server caches their device copies by content
   * and does not merge such requests (a batch would need one weight set). */
  MOE_INPUT_WEIGHT = 1u << 0,
  /* An input that an expert set holds when one is passed to moe_op_prepare
   * (every weight, and correction_bias, which the set's files carry):
   * prepare rejects it then, so a set's model does not advertise it. */
  MOE_INPUT_SET_HELD = 1u << 1,
  /* An input or output in the activation dtype, which an expert set fixes
   * (moe_expert_set_act_dtypes): a set's model advertises that one. */
  MOE_IO_ACTIVATION = 1u << 2,
};

/* Static description of an op's interface, for ModelMetadata/ModelConfig. */
typedef struct moe_op_io_desc {
  const char *name;
  bool optional;
  const char *dtypes; /* comma-separated dtype names accepted / produced */
  unsigned flags;     /* MOE_INPUT_* (inputs only), MOE_IO_* */
  /* The advertised shape, one comma-separated axis per dimension (its
   * count is the rank): "T" the token axis (first; what the server merges
   * requests along), "H" the hidden size and "E" the number of experts
   * (fixed by an expert set, free otherwise), a number a fixed size, any
   * other name a free size. Ops that take any rank (the quant ops) say the
   * [T, K] layout of an activation they are called on; they accept other
   * ranks too. */
  const char *axes;
} moe_op_io_desc;

typedef struct moe_op_info {
  const char *name;
  const moe_op_io_desc *inputs;
  size_t num_inputs;
  const moe_op_io_desc *outputs;
  size_t num_outputs;
  /* True when row r of every output depends only on row r of the row-major
   * inputs (merged along the first axis by the batcher). False e.g. for
   * dynamic per-tensor quant, whose scale depends on the whole tensor. */
  bool rows_independent;
} moe_op_info;

const moe_op_info *moe_op_describe(const moe_op *op);

/* True when some input of op is a MOE_INPUT_WEIGHT: the op computes with
 * expert weights, from an expert set or from its inputs. */
bool moe_op_takes_weights(const moe_op *op);
/* The op that an expert set is served as: the first in the table that
 * takes weights (fused_moe); NULL when none does. */
const moe_op *moe_op_for_expert_sets(void);
/* The dtypes (as in moe_op_io_desc.dtypes) that set's MOE_IO_ACTIVATION
 * tensors have: its scheme's activation dtype ("bf16", "fp16"), or every
 * 16-bit one for a scheme that computes in either (wna16). */
const char *moe_expert_set_act_dtypes(const moe_expert_set *set);

/* True when backend b has a kernel for op (the CPU runs every op; a GPU
 * build may lack some): callers route such calls to a host backend. */
bool moe_op_supported(const moe_op *op, const moe_backend *b);
/* The same for a prepared call: its op, and for fused_moe on a GPU the
 * expert set's scheme and biases (the GPU kernels serve bf16, fp16 and
 * wna16 without biases; docs/design.md "Weight schemes on the GPU").
 * MOE_EUNSUPPORTED naming what is missing; callers route such calls to a
 * host backend (moe_call_run refuses them with the same message). */
moe_status moe_call_check_backend(const moe_call *c, const moe_backend *b, moe_error *err);

/* Validates inputs and params and creates a call whose outputs have their
 * dtype, shape and nbytes set and data NULL. `set` is the expert set for
 * "fused_moe" called as a loaded model (NULL: weights must be inputs). The
 * input tensors' descriptors are copied; their data must stay valid until
 * the call is run. */
moe_status moe_op_prepare(const moe_op *op, const moe_named_tensor *inputs, size_t num_inputs,
                          const moe_params *params, const moe_expert_set *set, moe_call **out,
                          moe_error *err);
size_t moe_call_num_outputs(const moe_call *c);
/* Set ->tensor.data (and .nbytes, at least the size given) before running. */
moe_named_tensor *moe_call_output(moe_call *c, size_t i);
/* Input tensors may be rebound (e.g. to device copies) before running. */
size_t moe_call_num_inputs(const moe_call *c);
moe_named_tensor *moe_call_input(moe_call *c, size_t i);
/* Runs on `b` (NULL: the default backend). Inputs and outputs must live in
 * b's memory. */
moe_status moe_call_run(moe_call *c, moe_backend *b, moe_error *err);
/* Lets a caller stop a long run: the CPU backend's fused_moe asks stop(ctx)
 * before each work item of its GEMMs (a strip of one expert's weights, a few
 * ms at most) and, once it answers true, skips the rest and returns
 * MOE_ECANCELLED (outputs undefined). stop may be called from several
 * threads at once. GPU runs queue their kernels at once and are not
 * stopped (their longest op is milliseconds). */
typedef bool (*moe_stop_fn)(void *ctx);
void moe_call_set_stop(moe_call *c, moe_stop_fn stop, void *ctx);
void moe_call_destroy(moe_call *c);

/* Convenience for host memory: prepare + allocate outputs (malloc; the caller
 * frees each outputs[i].tensor.data and the array) + run on the CPU backend. */
moe_status moe_run_host(const char *op, const moe_named_tensor *inputs, size_t num_inputs,
                        const moe_params *params, const moe_expert_set *set, moe_named_tensor **outputs,
                        size_t *num_outputs, moe_error *err);
void moe_outputs_free(moe_named_tensor *outputs, size_t n);

#ifdef __cplusplus
}
#endif
#endif
