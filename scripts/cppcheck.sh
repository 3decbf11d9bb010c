#!/usr/bin/env bash
# Static analysis of the C sources (cppcheck: warnings, portability,
# performance); fails on any finding not suppressed. Suppressions: inline
# (/* cppcheck-suppress ID */ with the reason beside it) or, for a whole
# class, scripts/cppcheck.supp (each with its reason). Generated protobuf
# code and the HIP kernels (C++) are not checked here.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.c' | grep -v '^shared/')
cppcheck --std=c11 --enable=warning,portability,performance --inline-suppr --error-exitcode=1 -q \
  --suppress=missingIncludeSystem --suppress=missingInclude \
  --suppressions-list=scripts/cppcheck.supp \
  -I kernels/include -I server -I proto "${files[@]}"
echo "cppcheck: ${#files[@]} files, no findings"
