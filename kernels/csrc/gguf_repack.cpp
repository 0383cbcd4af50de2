// The load-time repack of GGUF blocks into weft's layouts, one pass over the file's bytes
// (services/worker/gguf_repack.py holds the numpy twins and says what each field becomes).
// Registered into the fused kernels' library (torch.ops.weft_fused).
//
//   block_bytes(out, blocks, start, stop)
//     bytes [start, stop) of each block of blocks [N, B, bytes] into out [N, B, stop - start]: a
//     format's quants or scales pulled out of its blocks (numpy copies a strided field item by item)
//
//   k_records_and_nibbles(records, nibbles, blocks, qs_start)
//     blocks   [N, B, bytes] uint8: a tensor's super-blocks as the file holds them (144 bytes a
//              Q4_K block, 176 a Q5_K one); qs_start: where its 128 bytes of nibbles begin
//     records  [N, B, 20] uint8: d and dmin (fp16, as stored), then the eight 6-bit scales and the
//              eight 6-bit mins a byte each
//     nibbles  [N, B, 128] uint8: group g's 32 weights in 16 bytes, element j in the low nibble of
//              byte j and element j + 16 in its high nibble, groups in order
//
// Every field moves within its byte, so the work goes eight (nibbles) or four (records) bytes to
// an integer, as the twin's; numpy runs the same arithmetic as a dozen passes with temporaries
// (1.35 s of CPU for the 1B shape's Q4_K tensors on an AVX2 EPYC), this one pass over the rows in
// parallel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kRecordBytes = 20;
constexpr int64_t kNibbleBytes = 128;
constexpr int64_t kScalesStart = 4;  // d, dmin (fp16), then 12 bytes of packed 6-bit scales and mins

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// One super-block: its record and its nibbles in weft's order.
void repack_block(const uint8_t* block, int64_t qs_start, uint8_t* record, uint8_t* nibbles) {
  // The 12 bytes of 6-bit (scale, min) pairs as words d, m, md (a byte a group, groups 0-3):
  // scales 0-3 are d's low six bits, 4-7 md's low nibbles under d's top two; mins likewise from
  // m and md's high nibbles.
  const uint32_t d = load<uint32_t>(block + kScalesStart), m = load<uint32_t>(block + kScalesStart + 4),
                 md = load<uint32_t>(block + kScalesStart + 8);
  const uint32_t six = 0x3F3F3F3Fu, nibble = 0x0F0F0F0Fu, top = 0x30303030u;
  store<uint32_t>(record, load<uint32_t>(block));  // d and dmin
  store<uint32_t>(record + 4, d & six);
  store<uint32_t>(record + 8, (md & nibble) | ((d >> 2) & top));
  store<uint32_t>(record + 12, m & six);
  store<uint32_t>(record + 16, ((md >> 4) & nibble) | ((m >> 2) & top));
  // 4 chunks of 32 bytes: chunk c holds group 2c in its low nibbles and 2c + 1 in its high ones,
  // element j in byte j. Each group's bytes come from the chunk's halves a (bytes 0-15) and
  // b (16-31), a nibble moved.
  const uint64_t low = 0x0F0F0F0F0F0F0F0Full, high = 0xF0F0F0F0F0F0F0F0ull;
  const uint8_t* qs = block + qs_start;
  for (int c = 0; c < 4; ++c) {
    for (int w = 0; w < 2; ++w) {
      const uint64_t a = load<uint64_t>(qs + 32 * c + 8 * w), b = load<uint64_t>(qs + 32 * c + 16 + 8 * w);
      store<uint64_t>(nibbles + 32 * c + 8 * w, (a & low) | ((b << 4) & high));  // group 2c
      store<uint64_t>(nibbles + 32 * c + 16 + 8 * w, ((a >> 4) & low) | (b & high));  // group 2c + 1
    }
  }
}

void k_records_and_nibbles(at::Tensor& records, at::Tensor& nibbles, const at::Tensor& blocks, int64_t qs_start) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous(),
              "k_records_and_nibbles: blocks [N, B, bytes] contiguous uint8 expected");
  const int64_t rows = blocks.size(0), per_row = blocks.size(1), bytes = blocks.size(2);
  TORCH_CHECK(qs_start >= kScalesStart + 12 && qs_start + kNibbleBytes <= bytes,
              "k_records_and_nibbles: the nibbles [qs_start, qs_start + 128) must follow the scales inside a ",
              bytes, "-byte block, got qs_start ", qs_start);
  TORCH_CHECK(records.scalar_type() == at::kByte && records.is_contiguous() &&
                  records.sizes() == at::IntArrayRef({rows, per_row, kRecordBytes}),
              "k_records_and_nibbles: records [N, B, 20] contiguous uint8 expected");
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.is_contiguous() &&
                  nibbles.numel() == rows * per_row * kNibbleBytes,
              "k_records_and_nibbles: nibbles of N * B * 128 contiguous uint8 expected");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* rec = records.data_ptr<uint8_t>();
  uint8_t* nib = nibbles.data_ptr<uint8_t>();
  const int64_t total = rows * per_row;
  at::parallel_for(0, total, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      repack_block(src + i * bytes, qs_start, rec + i * kRecordBytes, nib + i * kNibbleBytes);
    }
  });
}

void block_bytes(at::Tensor& out, const at::Tensor& blocks, int64_t start, int64_t stop) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous(),
              "block_bytes: blocks [N, B, bytes] contiguous uint8 expected");
  const int64_t total = blocks.size(0) * blocks.size(1), bytes = blocks.size(2), width = stop - start;
  TORCH_CHECK(0 <= start && start < stop && stop <= bytes, "block_bytes: [start, stop) must lie inside a ", bytes,
              "-byte block, got [", start, ", ", stop, ")");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == total * width,
              "block_bytes: out of N * B * (stop - start) contiguous uint8 expected");
  const uint8_t* src = blocks.data_ptr<uint8_t>() + start;
  uint8_t* dst = out.data_ptr<uint8_t>();
  // The formats' field widths as constants, so each copy is a few moves rather than a call to
  // memcpy per block (tens of millions of blocks in a 1B model).
  auto copy = [&](auto fixed) {
    constexpr int64_t kWidth = decltype(fixed)::value;
    const int64_t w = kWidth > 0 ? kWidth : width;
    at::parallel_for(0, total, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * w, src + i * bytes, kWidth > 0 ? kWidth : w);
    });
  };
  switch (width) {
    case 2: copy(std::integral_constant<int64_t, 2>{}); break;
    case 4: copy(std::integral_constant<int64_t, 4>{}); break;
    case 16: copy(std::integral_constant<int64_t, 16>{}); break;
    case 32: copy(std::integral_constant<int64_t, 32>{}); break;
    case 64: copy(std::integral_constant<int64_t, 64>{}); break;
    case 128: copy(std::integral_constant<int64_t, 128>{}); break;
    default: copy(std::integral_constant<int64_t, 0>{});
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weft_fused, m) {
  m.def("k_records_and_nibbles(Tensor(a!) records, Tensor(b!) nibbles, Tensor blocks, int qs_start) -> ()");
  m.def("block_bytes(Tensor(a!) out, Tensor blocks, int start, int stop) -> ()");
  m.impl("k_records_and_nibbles", c10::DispatchKey::CPU, &k_records_and_nibbles);
  m.impl("block_bytes", c10::DispatchKey::CPU, &block_bytes);
}
