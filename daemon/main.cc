// sparkd: the per-node engine daemon (temporary skeleton; the daemon library grows here).
#include <cstdio>
int main() { std::puts("sparkd"); return 0; }
