// What the AVX2 (and, where the CPU has them, AVX-512 VNNI) vector pipes of this CPU issue per
// cycle, alone and in the instruction mixes of int8 GEMMs: the evidence for what bounds weft's AVX2
// int8 GEMM (kernels/csrc/cpu_avx2_int8.cpp) and the packed kernel's int4 and super-block tiles on
// batched steps (kernels/csrc/cpu_quant_linear.cpp).
// Built and run by benchmarks/scripts/vector_ops_bench.py; one thread, registers only (no memory traffic but
// the broadcasts' L1 hits). Cycles are counted by a chain of dependent scalar adds (one a cycle) run
// in the same process, so no clock speed is assumed.

#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int64_t row[64] __attribute__((aligned(64)));
static const long kIters = 50000000;

// Each loop body is one asm string run kIters times; the ymm registers it names are its own.
#define LOOP(body)                                                                       \
  do {                                                                                   \
    long n = kIters;                                                                     \
    __asm__ volatile("1:\n\t" body "dec %0\n\tjnz 1b" : "+r"(n) : "r"(row) : "memory"); \
  } while (0)

static double seconds_of(void (*fn)(void)) {
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    double t = now();
    fn();
    t = now() - t;
    if (t < best) best = t;
  }
  return best;
}

// Eight dependent adds an iteration: eight cycles. The addend is a register: cores that fold
// chains of adds of an immediate at rename (Intel's since Golden Cove) ran the $1 form at about
// three a cycle, which read as an 8 GHz clock.
static void clock_chain(void) {
  long x = 0, n = kIters, one = 1;
  __asm__ volatile(
      "1:\n\tadd %2, %0\n\tadd %2, %0\n\tadd %2, %0\n\tadd %2, %0\n\t"
      "add %2, %0\n\tadd %2, %0\n\tadd %2, %0\n\tadd %2, %0\n\tdec %1\n\tjnz 1b"
      : "+r"(x), "+r"(n)
      : "r"(one));
}

#define EIGHT(op) \
  op " %%ymm14, %%ymm15, %%ymm0\n\t" op " %%ymm14, %%ymm15, %%ymm1\n\t" op " %%ymm14, %%ymm15, %%ymm2\n\t" \
  op " %%ymm14, %%ymm15, %%ymm3\n\t" op " %%ymm14, %%ymm15, %%ymm4\n\t" op " %%ymm14, %%ymm15, %%ymm5\n\t" \
  op " %%ymm14, %%ymm15, %%ymm6\n\t" op " %%ymm14, %%ymm15, %%ymm7\n\t"

// The same on 512-bit vectors (run only where the CPU has AVX-512 BW and VNNI: main's argument).
#define EIGHT_Z(op) \
  op " %%zmm14, %%zmm15, %%zmm0\n\t" op " %%zmm14, %%zmm15, %%zmm1\n\t" op " %%zmm14, %%zmm15, %%zmm2\n\t" \
  op " %%zmm14, %%zmm15, %%zmm3\n\t" op " %%zmm14, %%zmm15, %%zmm4\n\t" op " %%zmm14, %%zmm15, %%zmm5\n\t" \
  op " %%zmm14, %%zmm15, %%zmm6\n\t" op " %%zmm14, %%zmm15, %%zmm7\n\t"

static void paddd(void) { LOOP(EIGHT("vpaddd")); }
static void pmaddubsw_z(void) { LOOP(EIGHT_Z("vpmaddubsw")); }
static void paddw_z(void) { LOOP(EIGHT_Z("vpaddw")); }
// The accumulating dots into twelve accumulators, each its own chain: more than their latency
// (5 cycles) times the two a cycle a core might issue, so the count is their issue rate.
#define TWELVE(op, r)                                                                                  \
  EIGHT_OF(op, r) op " %%" r "14, %%" r "15, %%" r "8\n\t" op " %%" r "14, %%" r "15, %%" r "9\n\t" \
      op " %%" r "14, %%" r "15, %%" r "10\n\t" op " %%" r "14, %%" r "15, %%" r "11\n\t"
#define EIGHT_OF(op, r)                                                                               \
  op " %%" r "14, %%" r "15, %%" r "0\n\t" op " %%" r "14, %%" r "15, %%" r "1\n\t" op " %%" r "14, %%" r \
     "15, %%" r "2\n\t" op " %%" r "14, %%" r "15, %%" r "3\n\t" op " %%" r "14, %%" r "15, %%" r      \
     "4\n\t" op " %%" r "14, %%" r "15, %%" r "5\n\t" op " %%" r "14, %%" r "15, %%" r "6\n\t" op " %%" r \
     "14, %%" r "15, %%" r "7\n\t"
static void dpbusd_y(void) { LOOP(TWELVE("vpdpbusd", "ymm")); }
static void dpbusd_z(void) { LOOP(TWELVE("vpdpbusd", "zmm")); }
static void dpwssd_z(void) { LOOP(TWELVE("vpdpwssd", "zmm")); }
// The AVX-512 super-block tile's work per (pair of weight rows, row of x, pair of groups): two
// vpmaddubsw, a vpaddw and a vpdpwssd by the groups' scales into one of eight accumulators.
#define SUPER_Z(acc)                                                                                \
  "vpmaddubsw %%zmm14, %%zmm15, %%zmm10\n\tvpmaddubsw %%zmm13, %%zmm15, %%zmm11\n\t"                \
  "vpaddw %%zmm10, %%zmm11, %%zmm10\n\tvpdpwssd %%zmm12, %%zmm10, " acc "\n\t"
static void super_pairs_z(void) {
  LOOP(SUPER_Z("%%zmm0") SUPER_Z("%%zmm1") SUPER_Z("%%zmm2") SUPER_Z("%%zmm3") SUPER_Z("%%zmm4") SUPER_Z("%%zmm5")
           SUPER_Z("%%zmm6") SUPER_Z("%%zmm7"));
}
static void pmaddubsw(void) { LOOP(EIGHT("vpmaddubsw")); }
static void pmaddwd(void) { LOOP(EIGHT("vpmaddwd")); }
static void psignb(void) { LOOP(EIGHT("vpsignb")); }
static void fmadd(void) { LOOP(EIGHT("vfmadd231ps")); }
static void pabsb(void) {
  LOOP("vpabsb %%ymm15, %%ymm0\n\tvpabsb %%ymm15, %%ymm1\n\tvpabsb %%ymm15, %%ymm2\n\tvpabsb %%ymm15, %%ymm3\n\t"
       "vpabsb %%ymm15, %%ymm4\n\tvpabsb %%ymm15, %%ymm5\n\tvpabsb %%ymm15, %%ymm6\n\tvpabsb %%ymm15, %%ymm7\n\t");
}
static void broadcast(void) {
  LOOP("vpbroadcastd (%1), %%ymm0\n\tvpbroadcastd 4(%1), %%ymm1\n\tvpbroadcastd 8(%1), %%ymm2\n\t"
       "vpbroadcastd 12(%1), %%ymm3\n\t");
}

// One row of the 4-row x 16-output tile of weft's AVX2 int8 GEMM, per word (4 columns): |x| once,
// then for each of the two weight vectors (ymm14, ymm15) vpsignb, vpmaddubsw, vpmaddwd by ones
// (ymm13), vpaddd into the row's two sums.
#define SIGNED_ROW(off, s0, s1)                                                                       \
  "vpbroadcastd " off "(%1), %%ymm8\n\tvpabsb %%ymm8, %%ymm9\n\t"                                   \
  "vpsignb %%ymm8, %%ymm14, %%ymm10\n\tvpmaddubsw %%ymm10, %%ymm9, %%ymm10\n\t"                    \
  "vpmaddwd %%ymm13, %%ymm10, %%ymm10\n\tvpaddd %%ymm10, " s0 ", " s0 "\n\t"                       \
  "vpsignb %%ymm8, %%ymm15, %%ymm11\n\tvpmaddubsw %%ymm11, %%ymm9, %%ymm11\n\t"                    \
  "vpmaddwd %%ymm13, %%ymm11, %%ymm11\n\tvpaddd %%ymm11, " s1 ", " s1 "\n\t"
static void gemm_signed(void) {
  LOOP(SIGNED_ROW("0", "%%ymm0", "%%ymm1") SIGNED_ROW("4", "%%ymm2", "%%ymm3") SIGNED_ROW("8", "%%ymm4", "%%ymm5")
           SIGNED_ROW("12", "%%ymm6", "%%ymm7"));
}

// The same tile with x already unsigned (x + 64 for 7-bit x): no vpabsb, no vpsignb.
#define UNSIGNED_ROW(off, s0, s1)                                                                    \
  "vpbroadcastd " off "(%1), %%ymm8\n\t"                                                             \
  "vpmaddubsw %%ymm14, %%ymm8, %%ymm10\n\tvpmaddwd %%ymm13, %%ymm10, %%ymm10\n\t"                  \
  "vpaddd %%ymm10, " s0 ", " s0 "\n\t"                                                             \
  "vpmaddubsw %%ymm15, %%ymm8, %%ymm11\n\tvpmaddwd %%ymm13, %%ymm11, %%ymm11\n\t"                  \
  "vpaddd %%ymm11, " s1 ", " s1 "\n\t"
static void gemm_unsigned(void) {
  LOOP(UNSIGNED_ROW("0", "%%ymm0", "%%ymm1") UNSIGNED_ROW("4", "%%ymm2", "%%ymm3")
           UNSIGNED_ROW("8", "%%ymm4", "%%ymm5") UNSIGNED_ROW("12", "%%ymm6", "%%ymm7"));
}

// int16 pairs: the 4 x 8 tile per word, W's 32 bytes widened (vpmovsxbw) and each row's 4
// columns broadcast as int16: vpmaddwd + vpaddd for 16 products.
#define INT16_ROW(off, s0, s1)                                                                       \
  "vpbroadcastq " off "(%1), %%ymm8\n\t"                                                             \
  "vpmaddwd %%ymm8, %%ymm14, %%ymm10\n\tvpaddd %%ymm10, " s0 ", " s0 "\n\t"                        \
  "vpmaddwd %%ymm8, %%ymm15, %%ymm11\n\tvpaddd %%ymm11, " s1 ", " s1 "\n\t"
static void gemm_int16(void) {
  LOOP("vpmovsxbw 64(%1), %%ymm14\n\tvpmovsxbw 80(%1), %%ymm15\n\t" INT16_ROW("0", "%%ymm0", "%%ymm1")
           INT16_ROW("8", "%%ymm2", "%%ymm3") INT16_ROW("16", "%%ymm4", "%%ymm5") INT16_ROW("24", "%%ymm6", "%%ymm7"));
}

// One (weight row, row of x) step of quant_linear_i8's int4 tiles per pair of 32-blocks (64
// products): the low and high nibbles (ymm14, ymm15, unpacked once per weight row for all rows of
// x, so not counted) against x's two 32-byte halves from L1, vpaddw, vpmaddwd by ones (ymm13), the
// conversion to fp32 and the FMA by the scale product (ymm12) into the pair's own accumulator.
// PACKED_DOT is the same without the fp32 tail (the integer dot alone).
#define PACKED_DOT(lo, hi)                                                                           \
  "vpmaddubsw " lo "(%1), %%ymm14, %%ymm10\n\tvpmaddubsw " hi "(%1), %%ymm15, %%ymm11\n\t"       \
  "vpaddw %%ymm11, %%ymm10, %%ymm10\n\tvpmaddwd %%ymm13, %%ymm10, %%ymm10\n\t"
#define PACKED_PAIR(lo, hi, acc) \
  PACKED_DOT(lo, hi) "vcvtdq2ps %%ymm10, %%ymm10\n\tvfmadd231ps %%ymm12, %%ymm10, " acc "\n\t"
#define PACKED_INT(lo, hi, acc) PACKED_DOT(lo, hi) "vpaddd %%ymm10, " acc ", " acc "\n\t"
static void packed_pairs(void) {
  LOOP(PACKED_PAIR("0", "32", "%%ymm0") PACKED_PAIR("64", "96", "%%ymm1") PACKED_PAIR("128", "160", "%%ymm2")
           PACKED_PAIR("192", "224", "%%ymm3") PACKED_PAIR("256", "288", "%%ymm4")
               PACKED_PAIR("320", "352", "%%ymm5") PACKED_PAIR("384", "416", "%%ymm6")
                   PACKED_PAIR("448", "480", "%%ymm7"));
}
static void packed_dots(void) {
  LOOP(PACKED_INT("0", "32", "%%ymm0") PACKED_INT("64", "96", "%%ymm1") PACKED_INT("128", "160", "%%ymm2")
           PACKED_INT("192", "224", "%%ymm3") PACKED_INT("256", "288", "%%ymm4") PACKED_INT("320", "352", "%%ymm5")
               PACKED_INT("384", "416", "%%ymm6") PACKED_INT("448", "480", "%%ymm7"));
}

int main(int argc, char** argv) {
  const int avx512 = argc > 1;  // the CPU has AVX-512 BW and VNNI (vector_ops_bench.py says so)
  const double cycle = seconds_of(clock_chain) / (8.0 * kIters);  // seconds a cycle
  printf("clock %.2f GHz (a chain of dependent adds)\n", 1e-9 / cycle);
  struct {
    const char* name;
    void (*fn)(void);
    int ops;   // vector instructions an iteration, loads included
    int macs;  // int8 products an iteration (0: not a GEMM mix)
  } cases[] = {
      {"vpaddd", paddd, 8, 0},
      {"vpmaddubsw", pmaddubsw, 8, 0},
      {"vpmaddwd", pmaddwd, 8, 0},
      {"vpsignb", psignb, 8, 0},
      {"vpabsb", pabsb, 8, 0},
      {"vpbroadcastd (from L1)", broadcast, 4, 0},
      {"vfmadd231ps", fmadd, 8, 0},
      {"GEMM word, signed x (weft's)", gemm_signed, 4 * 10, 256},
      {"GEMM word, 7-bit x + 64", gemm_unsigned, 4 * 7, 256},
      {"GEMM word, int16 pairs", gemm_int16, 2 + 4 * 5, 128},
      {"packed int4 pair (weft's tile)", packed_pairs, 8 * 6, 8 * 64},
      {"packed int4 pair, int dot only", packed_dots, 8 * 5, 8 * 64},
      // AVX-512 from here (kAvx512First); MAC counts are int8 products (vpdpwssd's int16 ones for
      // its line alone).
      {"vpdpbusd ymm", dpbusd_y, 12, 12 * 32},
      {"vpdpbusd zmm", dpbusd_z, 12, 12 * 64},
      {"vpmaddubsw zmm", pmaddubsw_z, 8, 8 * 64},
      {"vpdpwssd zmm (int16 products)", dpwssd_z, 12, 12 * 32},
      {"vpaddw zmm", paddw_z, 8, 0},
      {"super-block pair zmm (weft's)", super_pairs_z, 8 * 4, 8 * 128},
  };
  const unsigned kAvx512First = 12;
  printf("%-30s %12s %12s %14s\n", "instructions", "ops/cycle", "MAC/cycle", "cycles/256 MAC");
  for (unsigned i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
    if (i >= kAvx512First && !avx512) break;
    const double cycles = seconds_of(cases[i].fn) / cycle / kIters;  // an iteration's
    if (cases[i].macs)
      printf("%-30s %12.2f %12.1f %14.1f\n", cases[i].name, cases[i].ops / cycles, cases[i].macs / cycles,
             cycles * 256.0 / cases[i].macs);
    else
      printf("%-30s %12.2f\n", cases[i].name, cases[i].ops / cycles);
  }
  return 0;
}
