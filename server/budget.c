/* budget: byte budgets that many connections or calls draw on together
 * (--http-body-budget-bytes for HTTP bodies, --grpc-body-budget-bytes for
 * gRPC request messages): each claim is checked against what all of them
 * hold, so that no number of clients makes moed hold more. Any thread. */
#include "moed.h"

bool moed_budget_claim(_Atomic size_t *held, size_t n, size_t budget) {
  size_t now = atomic_load(held);
  do {
    if (n > budget || now > budget - n) return false;
  } while (!atomic_compare_exchange_weak(held, &now, now + n));
  return true;
}

void moed_budget_release(_Atomic size_t *held, size_t n) { atomic_fetch_sub(held, n); }
