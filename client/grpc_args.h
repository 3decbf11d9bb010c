/* Channel/server arguments shared by moec and the bench tools: gRPC's
 * message size limits (default 4 MiB receive) raised to `bytes` both ways,
 * since MoE activations and weights are far larger. */
#ifndef MOEC_GRPC_ARGS_H
#define MOEC_GRPC_ARGS_H

#include <string.h>

#include <grpc/grpc.h>

/* Fills args[2] and returns the grpc_channel_args that point at them. */
static inline grpc_channel_args moec_size_args(grpc_arg args[2], int bytes) {
  memset(args, 0, 2 * sizeof *args);
  args[0].type = args[1].type = GRPC_ARG_INTEGER;
  args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
  args[0].value.integer = args[1].value.integer = bytes;
  return (grpc_channel_args){2, args};
}

#endif
