/* Internal: parameter parsing and checks shared by the quant/dequant ops. */
#ifndef MOE_OPS_QUANT_ARGS_H
#define MOE_OPS_QUANT_ARGS_H

#include "op.h"

/* Parses a scaled format parameter (fp8_e4m3fn | fp8_e4m3fnuz | int8) named
 * `param` into a->qdtype, a->fmt, a->dtype_max; `dflt` when absent. */
moe_status moe_parse_scaled_dtype(const moe_params *p, const char *param, moe_dtype dflt, moe_scaled_args *a,
                                  moe_error *err);
/* `format` (mxfp4 | mxfp8_e4m3fn | mxfp8_e5m2, default mxfp4) into a->qdtype
 * and a->fmt. */
moe_status moe_parse_mx_format(const moe_params *p, moe_mx_args *a, moe_error *err);
/* `out_dtype` of a dequant op: fp32 (default) | fp16 | bf16. */
moe_status moe_parse_out_float(const moe_params *p, moe_dtype *out, moe_error *err);
/* A scale tensor: F32 with one element, finite and > 0 (docs/numerics.md
 * quant.per_tensor "Static"); its value into *out. */
moe_status moe_read_static_scale(const moe_tensor *t, const char *what, float *out, moe_error *err);

/* The input dtypes quant ops accept (F32, F16, BF16), terminated. */
extern const moe_dtype moe_float_dtypes[];

#endif
