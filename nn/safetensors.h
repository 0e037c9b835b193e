// Safetensors checkpoints (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
// little-endian data. Files written here load in PyTorch/JAX and vice versa.
//
//   save_safetensors("model.safetensors", {{"w", w}, {"b", b}}, {{"step", "1000"}});
//   SafetensorsFile f = load_safetensors("model.safetensors");
//   Tensor w2 = f.tensors.at("w");            // contiguous, on the CPU
//   std::string step = f.metadata.at("step");
//
// Saving is atomic (temp file, fsync, rename); loading validates the whole header and throws
// tessera::Error naming the path and the tensor on anything malformed.
#pragma once

#include <map>
#include <string>

#include "tensor/tensor.h"

namespace tessera::nn {

// Writes `tensors` (any device, any strides; copied to host contiguous) and string metadata
// to `path`. The data goes to `path + ".tmp.<pid>"` first, is fsync'd and renamed over
// `path`, so an existing file is replaced whole or not at all.
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The first half of save_safetensors: the whole file written to `tmp_path` and fsync'd, not
// renamed; for callers that commit several files together (models/common/checkpoint.h). On
// failure nothing is left at tmp_path.
void write_safetensors_file(const std::string& tmp_path,
                            const std::map<std::string, Tensor>& tensors,
                            const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // contiguous CPU tensors
  std::map<std::string, std::string> metadata;
};

// Reads and validates a whole file: header length, JSON, dtypes, shapes against byte ranges,
// ranges that tile the data section exactly (no overlap, gap, truncation or trailing bytes).
SafetensorsFile load_safetensors(const std::string& path);

// Only the header's __metadata__, after validating the header and the layout as
// load_safetensors does (no tensor data is read): cheap enough to inspect many files.
std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

// "F32" <-> DType::f32, ...; the names the format uses for Tessera's dtypes.
std::string safetensors_dtype_name(DType dtype);

}  // namespace tessera::nn
