/* Tuned tile configurations of the tensor-core fused_moe (fused_moe_tc.hip's
 * Tuned rows; the last row ends the table). Written by
 * `moe-bench-gpu --fused --tune FILE` on the device it names; the rows
 * below are its output as measured (bench/RESULTS.md, tuner). Only rows
 * where a configuration beat the untuned choice by 3% or more. */
static const Tuned tuned[] = {
    {"NVIDIA H200", 256, 7168, 2048, TW_16, 65, INT64_MAX, TC_TALL},
    {nullptr, 0, 0, 0, 0, 0, 0, 0},
};
