/* moe-mkset: writes a synthetic expert set (config.json + weights.safetensors
 * with seeded random weights) for tests, benchmarks and demos.
 * docs/expert-set.md describes the format. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/expert_set.h"

static void usage(FILE *f) {
  fprintf(f, "usage: moe-mkset --out DIR --experts N --hidden H --intermediate I [options]\n"
             "Writes DIR/config.json and DIR/weights.safetensors with seeded random weights.\n"
             "\n"
             "  --out DIR                 directory to write (created, parents too)\n"
             "  --scheme S                bf16 (default), fp16, wna16, fp8 or mxfp4\n"
             "  --experts N               experts held in this set\n"
             "  --hidden H                hidden size\n"
             "  --intermediate I          intermediate size (per expert)\n"
             "  --activation A            silu (default), gelu or swiglu_oai\n"
             "  --bits B                  wna16: 4 (default) or 8\n"
             "  --group-size G            wna16: divides H and I, or -1 (default) for one group per row\n"
             "  --zero-points             wna16: write zero points (default: implicit 8 / 128)\n"
             "  --weight-scale L          fp8: per_tensor (default), per_channel or block\n"
             "  --block-n BN              fp8 block: rows per scale block (default 128)\n"
             "  --block-k BK              fp8 block: columns per scale block, divides H and I (default 128)\n"
             "  --activation-scales       fp8 per_tensor: write static a13_scale / a2_scale\n"
             "  --exact-division          fp8: quantize activations with x / s (default x * (1 / s))\n"
             "  --bias                    write expert biases w13_bias, w2_bias (any scheme)\n"
             "  --offset N                first global expert id held here (default 0)\n"
             "  --global-experts N        experts of the whole layer (default: --experts)\n"
             "  --top-k K                 routing: experts per token (default 1)\n"
             "  --scoring S               routing: softmax (default) or sigmoid\n"
             "  --renormalize             routing: renormalize the top-k weights\n"
             "  --num-expert-group G      routing: expert groups (default 1: none)\n"
             "  --topk-group g            routing: groups kept (default 1)\n"
             "  --routed-scaling-factor F routing: weight multiplier (default 1)\n"
             "  --seed N                  random seed (default 0)\n"
             "  -h, --help                this text\n");
}

static int parse_int(const char *opt, const char *arg, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(arg, &end, 10);
  if (errno || end == arg || *end) {
    fprintf(stderr, "moe-mkset: --%s: not an integer: '%s'\n", opt, arg);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_choice(const char *opt, const char *arg, const char *const *names, int *out) {
  for (int i = 0; names[i]; i++)
    if (strcmp(names[i], arg) == 0) {
      *out = i;
      return 0;
    }
  fprintf(stderr, "moe-mkset: --%s: unknown value '%s'\n", opt, arg);
  return -1;
}

enum {
  OPT_OUT = 256,
  OPT_SCHEME,
  OPT_EXPERTS,
  OPT_HIDDEN,
  OPT_INTERMEDIATE,
  OPT_ACTIVATION,
  OPT_BITS,
  OPT_GROUP_SIZE,
  OPT_ZERO_POINTS,
  OPT_WEIGHT_SCALE,
  OPT_BLOCK_N,
  OPT_BLOCK_K,
  OPT_ACT_SCALES,
  OPT_EXACT_DIVISION,
  OPT_BIAS,
  OPT_OFFSET,
  OPT_GLOBAL_EXPERTS,
  OPT_TOP_K,
  OPT_SCORING,
  OPT_RENORMALIZE,
  OPT_NUM_EXPERT_GROUP,
  OPT_TOPK_GROUP,
  OPT_SCALING,
  OPT_SEED,
};

static const struct option long_options[] = {
    {"out", required_argument, NULL, OPT_OUT},
    {"scheme", required_argument, NULL, OPT_SCHEME},
    {"experts", required_argument, NULL, OPT_EXPERTS},
    {"hidden", required_argument, NULL, OPT_HIDDEN},
    {"intermediate", required_argument, NULL, OPT_INTERMEDIATE},
    {"activation", required_argument, NULL, OPT_ACTIVATION},
    {"bits", required_argument, NULL, OPT_BITS},
    {"group-size", required_argument, NULL, OPT_GROUP_SIZE},
    {"zero-points", no_argument, NULL, OPT_ZERO_POINTS},
    {"weight-scale", required_argument, NULL, OPT_WEIGHT_SCALE},
    {"block-n", required_argument, NULL, OPT_BLOCK_N},
    {"block-k", required_argument, NULL, OPT_BLOCK_K},
    {"activation-scales", no_argument, NULL, OPT_ACT_SCALES},
    {"exact-division", no_argument, NULL, OPT_EXACT_DIVISION},
    {"bias", no_argument, NULL, OPT_BIAS},
    {"offset", required_argument, NULL, OPT_OFFSET},
    {"global-experts", required_argument, NULL, OPT_GLOBAL_EXPERTS},
    {"top-k", required_argument, NULL, OPT_TOP_K},
    {"scoring", required_argument, NULL, OPT_SCORING},
    {"renormalize", no_argument, NULL, OPT_RENORMALIZE},
    {"num-expert-group", required_argument, NULL, OPT_NUM_EXPERT_GROUP},
    {"topk-group", required_argument, NULL, OPT_TOPK_GROUP},
    {"routed-scaling-factor", required_argument, NULL, OPT_SCALING},
    {"seed", required_argument, NULL, OPT_SEED},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

int main(int argc, char **argv) {
  moe_expert_config cfg;
  moe_expert_config_defaults(&cfg);
  const char *out = NULL;
  int64_t bits = 0, global = 0, seed = 0;
  int choice = 0, rc = 0;
  char *end;
  for (int c; (c = getopt_long(argc, argv, "h", long_options, NULL)) != -1;) {
    const char *name = c >= OPT_OUT && c <= OPT_SEED ? long_options[c - OPT_OUT].name : "";
    switch (c) {
    case OPT_OUT: out = optarg; break;
    case OPT_SCHEME:
      if (!(rc = parse_choice(name, optarg, moe_scheme_names, &choice))) cfg.scheme = (moe_scheme)choice;
      break;
    case OPT_ACTIVATION:
      if (!(rc = parse_choice(name, optarg, moe_activation_names, &choice)))
        cfg.activation = (moe_activation)choice;
      break;
    case OPT_SCORING:
      if (!(rc = parse_choice(name, optarg, moe_scoring_names, &choice)))
        cfg.routing.scoring = (moe_scoring)choice;
      break;
    case OPT_EXPERTS: rc = parse_int(name, optarg, &cfg.num_experts); break;
    case OPT_HIDDEN: rc = parse_int(name, optarg, &cfg.hidden_size); break;
    case OPT_INTERMEDIATE: rc = parse_int(name, optarg, &cfg.intermediate_size); break;
    case OPT_BITS: rc = parse_int(name, optarg, &bits); break;
    case OPT_GROUP_SIZE: rc = parse_int(name, optarg, &cfg.group_size); break;
    case OPT_ZERO_POINTS: cfg.has_zero_points = true; break;
    case OPT_WEIGHT_SCALE:
      if (!(rc = parse_choice(name, optarg, moe_weight_scale_names, &choice)))
        cfg.weight_scale = (moe_weight_scale)choice;
      break;
    case OPT_BLOCK_N: rc = parse_int(name, optarg, &cfg.block_n); break;
    case OPT_BLOCK_K: rc = parse_int(name, optarg, &cfg.block_k); break;
    case OPT_ACT_SCALES: cfg.has_act_scales = true; break;
    case OPT_EXACT_DIVISION: cfg.exact_division = true; break;
    case OPT_BIAS: cfg.has_bias = true; break;
    case OPT_OFFSET: rc = parse_int(name, optarg, &cfg.expert_offset); break;
    case OPT_GLOBAL_EXPERTS: rc = parse_int(name, optarg, &global); break;
    case OPT_TOP_K: rc = parse_int(name, optarg, &cfg.routing.top_k); break;
    case OPT_RENORMALIZE: cfg.routing.renormalize = true; break;
    case OPT_NUM_EXPERT_GROUP: rc = parse_int(name, optarg, &cfg.routing.num_expert_group); break;
    case OPT_TOPK_GROUP: rc = parse_int(name, optarg, &cfg.routing.topk_group); break;
    case OPT_SCALING:
      errno = 0;
      cfg.routing.routed_scaling_factor = strtod(optarg, &end);
      if (errno || end == optarg || *end) {
        fprintf(stderr, "moe-mkset: --%s: not a number: '%s'\n", name, optarg);
        rc = -1;
      }
      break;
    case OPT_SEED: rc = parse_int(name, optarg, &seed); break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
    if (rc) return 2;
  }
  if (optind < argc) {
    fprintf(stderr, "moe-mkset: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (!out || !cfg.num_experts || !cfg.hidden_size || !cfg.intermediate_size) {
    fprintf(stderr, "moe-mkset: --out, --experts, --hidden and --intermediate are required\n");
    usage(stderr);
    return 2;
  }
  /* out-of-range values are left to the config's own checks and messages */
  if (bits < INT_MIN || bits > INT_MAX) bits = -1;
  cfg.bits = (cfg.scheme == MOE_SCHEME_WNA16 && bits == 0) ? 4 : (int)bits;
  cfg.global_num_experts = global ? global : cfg.num_experts;

  moe_error err = {{0}};
  moe_status s = moe_expert_set_write_random(out, &cfg, (uint64_t)seed, &err);
  if (s) {
    fprintf(stderr, "moe-mkset: %s (%s)\n", err.msg, moe_strerror(s));
    return 1;
  }
  printf("moe-mkset: wrote %s (scheme %s, %" PRId64 " experts of %" PRId64 ", H %" PRId64 ", I %" PRId64
         ")\n",
         out, moe_scheme_names[cfg.scheme], cfg.num_experts, cfg.global_num_experts, cfg.hidden_size,
         cfg.intermediate_size);
  return 0;
}
