// GGUF (ggml) block formats, as stored in the file, and the int8 forms activations take to meet
// them (llama.cpp's Q8_0 and Q8_K). One block holds 32 (legacy types) or 256 (K types) values of
// one weight row; a row of K values is K / block values' blocks back to back.
//
//   Q4_0  d        16 B nibbles            x = d * (q - 8)            18 B / 32
//   Q4_1  d, m     16 B nibbles            x = d * q + m              20 B / 32
//   Q5_0  d, qh    16 B nibbles + 32 bits  x = d * (q - 16)           22 B / 32
//   Q5_1  d, m, qh 16 B nibbles + 32 bits  x = d * q + m              24 B / 32
//   Q8_0  d        32 int8                 x = d * q                  34 B / 32
//   IQ4_NL d       16 B nibbles            x = d * kIQ4Values[q]      18 B / 32
//   Q4_K  d, dmin, 8 x 6-bit (scale, min), 128 B nibbles: x = d * sc * q - dmin * m  144 B / 256
//   Q5_K  as Q4_K plus 32 B of fifth bits                                            176 B / 256
//   Q2_K, Q3_K: 2 and 3 bits per value with 16-value groups (quant_x8_low_cpu.h)  84, 110 B / 256
//   IQ4_XS: 4-bit indices into a non-linear table, 6-bit scales (quant_x8_iq_cpu.h)   136 B / 256
//   Q6_K  128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, d: x = d * sc * (q - 32)
//                                                                                    210 B / 256
// (d, m, dmin: fp16.) Element j < 16 of a legacy block is the low nibble of byte j, element
// 16 + j its high nibble; bit j of qh is element j's fifth bit.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pagedattn_quant {

// ggml type ids (gguf.GGMLQuantizationType).
enum QType : int {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
};

constexpr int kBlock = 32;     // values per legacy block (and per Q8_0 activation block)
constexpr int kBlockK = 256;   // values per K block (and per Q8_K activation block)

#pragma pack(push, 1)
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[16];
};
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[16];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[32];
};
struct BlockQ2_K {
  uint8_t scales[16];  // scale | min << 4 per 16 values
  uint8_t qs[64];
  uint16_t d, dmin;
};
struct BlockQ3_K {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];  // 16 6-bit scales
  uint16_t d;
};
struct BlockIQ4_NL {  // Q4_0's layout; a nibble stands for kIQ4Values[nibble]
  uint16_t d;
  uint8_t qs[16];
};
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;    // 2 high bits per 32-value sub-block
  uint8_t scales_l[4];  // 4 low bits per sub-block
  uint8_t qs[128];
};
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "legacy 4-bit block sizes");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "legacy 5-bit block sizes");
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_K) == 144, "Q8_0 / Q4_K block sizes");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "Q2_K / Q3_K block sizes");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "IQ4 block sizes");

// llama.cpp's kvalues_iq4nl: the 16 values an IQ4_NL or IQ4_XS nibble stands for.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};
static_assert(sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "Q5_K / Q6_K block sizes");

// One 32-value block of an activation row in int8: x ~ d * q; sum = sum(q) and s = d * sum (for
// the weight types with an offset or a minimum, and Q8_0's unsigned weights on VNNI: their dot
// products need the block's sum).
struct ActQ8_0 {
  float d;
  float s;
  int32_t sum;
  int8_t qs[32];
};
// One 256-value block of an activation row in int8, with the sums of its 16-value groups and of
// its 32-value sub-blocks (sums32: two of them per 32-bit load, as the Q4_K kernels' mins take
// them).
struct ActQ8_K {
  float d;
  int16_t bsums[16];
  int16_t sums32[8];
  int8_t qs[256];
};

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (of 8), llama.cpp's packing.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The types whose activations are Q8_K blocks (256 values).
inline bool is_k_type(int type) { return (type >= kQ2_K && type <= kQ6_K) || type == kIQ4_XS; }

inline bool is_supported(int type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kIQ4_NL:
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS:
      return true;
    default:
      return false;
  }
}

inline int block_values(int type) { return is_k_type(type) ? kBlockK : kBlock; }

inline int block_bytes(int type) {
  switch (type) {
    case kQ4_0: return sizeof(BlockQ4_0);
    case kQ4_1: return sizeof(BlockQ4_1);
    case kQ5_0: return sizeof(BlockQ5_0);
    case kQ5_1: return sizeof(BlockQ5_1);
    case kQ8_0: return sizeof(BlockQ8_0);
    case kIQ4_NL: return sizeof(BlockIQ4_NL);
    case kQ2_K: return sizeof(BlockQ2_K);
    case kQ3_K: return sizeof(BlockQ3_K);
    case kQ4_K: return sizeof(BlockQ4_K);
    case kQ5_K: return sizeof(BlockQ5_K);
    case kQ6_K: return sizeof(BlockQ6_K);
    case kIQ4_XS: return sizeof(BlockIQ4_XS);
    default: return 0;
  }
}

}  // namespace pagedattn_quant
