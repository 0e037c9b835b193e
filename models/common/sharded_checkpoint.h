// Sharded checkpoints (like PyTorch's distributed checkpoint): a directory holding one
// safetensors file per writing rank, each with that rank's blocks of the global tensors and,
// in its header, where each block sits in its tensor (the global shape and the block's start).
// A reader builds the index from the headers alone and assembles whatever region it asks for
// from the blocks that overlap it, loading only those files: a rank of another layout reads
// its own shards without any rank materialising the whole model.
//
//   // every rank (collective order: prepare on rank 0, barrier, write, barrier, commit on 0)
//   if (rank == 0) prepare_sharded_checkpoint(dir);
//   ShardedCheckpointWriter w(dir, rank);
//   w.add("model/h.0.mlp.c_fc.weight", my_block, global_shape, starts);
//   w.write();
//   if (rank == 0) commit_sharded_checkpoint(dir);
//
//   ShardedCheckpointReader r(dir);
//   Tensor mine = r.read("model/h.0.mlp.c_fc.weight", starts, block_shape);
//
// Committing is atomic: the files are written into `dir`.tmp; the commit renames the current
// directory to `dir`.prev, the new one into place, and then removes the previous one, so a
// crash leaves `dir` or `dir`.prev complete (the reader falls back to `dir`.prev, saying so).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::models {

// Rank 0, before any writer: an empty `dir`.tmp (a killed save's leftovers removed).
void prepare_sharded_checkpoint(const std::string& dir);
// Rank 0, after every writer's write(): `dir`.tmp becomes `dir`.
void commit_sharded_checkpoint(const std::string& dir);
// Whether `path` is a sharded checkpoint directory (or its previous copy exists).
bool is_sharded_checkpoint(const std::string& path);
// Before training: Error naming `flag` unless a sharded checkpoint can be written at `path`
// (its parent is a writable directory; `path`, if it exists, is a directory).
void check_sharded_checkpoint_path(const std::string& path, const std::string& flag);

class ShardedCheckpointWriter {
 public:
  ShardedCheckpointWriter(std::string dir, int rank);
  // This rank's block of tensor `key` (global shape `global`; the block starts at `starts`
  // and has the block's shape). A tensor whole on this rank: add(key, t).
  void add(const std::string& key, const Tensor& block, const Shape& global,
           const std::vector<int64_t>& starts);
  void add(const std::string& key, const Tensor& whole);
  void set_metadata(const std::string& key, const std::string& value);
  // Writes `dir`.tmp/rank<r>.safetensors (fsync'd; nothing when nothing was added); Error on
  // a non-finite value.
  void write();

 private:
  std::string dir_;
  int rank_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

class ShardedCheckpointReader {
 public:
  // Reads every file's header (Error naming the directory when it holds none).
  explicit ShardedCheckpointReader(const std::string& path);

  const std::string& loaded_from() const { return dir_; }
  const std::string& fallback_reason() const { return fallback_; }
  bool has(const std::string& key) const { return index_.count(key) == 1; }
  Shape global_shape(const std::string& key) const;
  // Keys starting with `prefix`.
  std::vector<std::string> keys(const std::string& prefix) const;
  // The region [starts, starts + shape) of `key`, assembled from the blocks overlapping it
  // (Error naming the key when the blocks do not cover it).
  Tensor read(const std::string& key, const std::vector<int64_t>& starts, const Shape& shape);
  Tensor read(const std::string& key);  // the whole tensor
  // The metadata set_metadata() wrote (on any rank).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Block {
    std::string file;
    Shape shape;
    std::vector<int64_t> starts;
  };
  struct Entry {
    Shape global;
    std::vector<Block> blocks;
  };
  const Tensor& block(const std::string& file, const std::string& key);

  std::string dir_, fallback_;
  std::map<std::string, Entry> index_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, std::map<std::string, Tensor>> loaded_;  // file -> its tensors
};

}  // namespace tessera::models
