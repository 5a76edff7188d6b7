// pdlib_safetensors_header_bench: how long SafetensorsFile::Parse takes on a realistic header
// (a Llama-style model's tensor names, dtypes, shapes and offsets; 300 tensors by default), the
// JSON parse being most of it. It uses only the public pdlib_kernels API, so that the same file
// builds against an older tree for a before/after comparison.
//
//   pdlib_safetensors_header_bench [tensors=300] [iterations=2000]
//
// Prints a table row and one JSON line: the header's size, and microseconds per Parse (the
// best of 5 batches, and their median).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pdlib_kernels/safetensors.h"

namespace {

// The header names tensors as a Hugging Face checkpoint does; shapes are small (4 x 8 BF16) so
// that copying the file's bytes into Parse() costs little next to reading the header.
std::vector<uint8_t> MakeFile(int tensors, size_t* header_bytes) {
  static const char* const kParts[] = {
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
      "mlp.down_proj.weight",    "input_layernorm.weight",  "post_attention_layernorm.weight"};
  const uint64_t bytes_each = 4 * 8 * 2;
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (int i = 0; i < tensors; ++i) {
    const std::string name =
        "model.layers." + std::to_string(i / 9) + "." + kParts[static_cast<size_t>(i) % 9];
    header[name] = {
        {"dtype", "BF16"}, {"shape", {4, 8}}, {"data_offsets", {offset, offset + bytes_each}}};
    offset += bytes_each;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads to 8 bytes
  *header_bytes = text.size();
  std::vector<uint8_t> file(8);
  for (int b = 0; b < 8; ++b)
    file[static_cast<size_t>(b)] = static_cast<uint8_t>(text.size() >> (8 * b));
  file.insert(file.end(), text.begin(), text.end());
  file.resize(file.size() + offset);
  return file;
}

}  // namespace

int main(int argc, char** argv) {
  const int tensors = argc > 1 ? std::atoi(argv[1]) : 300;
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 2000;
  if (tensors < 1 || iterations < 1) {
    std::fprintf(stderr, "usage: pdlib_safetensors_header_bench [tensors>=1] [iterations>=1]\n");
    return 2;
  }
  size_t header_bytes = 0;
  const std::vector<uint8_t> file = MakeFile(tensors, &header_bytes);
  std::vector<double> batches;
  for (int batch = 0; batch < 5; ++batch) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) {
      auto parsed = pdlib::kernels::SafetensorsFile::Parse(file);
      if (!parsed.ok() || parsed->tensors().size() != static_cast<size_t>(tensors)) {
        std::fprintf(stderr, "parse failed: %s\n", std::string(parsed.status().message()).c_str());
        return 1;
      }
    }
    batches.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        iterations);
  }
  std::sort(batches.begin(), batches.end());
  std::printf("%-8s %-13s %-10s %-10s\n", "tensors", "header bytes", "best us", "median us");
  std::printf("%-8d %-13zu %-10.1f %-10.1f\n", tensors, header_bytes, batches[0], batches[2]);
  nlohmann::ordered_json j = {{"bench", "safetensors_header_parse"},
                              {"tensors", tensors},
                              {"header_bytes", header_bytes},
                              {"iterations", iterations},
                              {"best_us", static_cast<int64_t>(batches[0] * 10) / 10.0},
                              {"median_us", static_cast<int64_t>(batches[2] * 10) / 10.0}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
