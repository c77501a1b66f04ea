// Reading and writing checkpoints in the safetensors format.
//
// A SafetensorsFile is one .safetensors file mapped read-only into memory; its
// header is fully validated on Open (hostile input yields InvalidArgument, never
// a crash), and its TensorInfos point straight into the mapping. A Checkpoint is
// a directory of such files, resolved through model.safetensors.index.json when
// present. WriteCheckpoint streams a sharded checkpoint to disk tensor by tensor.
//
// Thread-safety: SafetensorsFile and Checkpoint are immutable after Open, so any
// number of threads may call their const methods concurrently. TensorInfo::data
// stays valid as long as the object that returned it lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/mapped_file.h"
#include "core/tensor.h"

namespace moe {

// One tensor inside a mapped safetensors file.
struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data;  // points into the mmap
  size_t nbytes;
};

// One .safetensors file, mmapped read-only.
class SafetensorsFile {
 public:
  // NotFound if the file does not exist; InvalidArgument (naming the file and
  // the problem) if it is not a well-formed safetensors file.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();  // munmap
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const TensorInfo* Find(std::string_view name) const;  // nullptr if absent
  // All tensors, in order of their position in the file.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }  // "__metadata__"
  const std::string& path() const { return path_; }
  // The open file (read-only; valid while this object lives), for read(2).
  int fd() const { return file_->fd(); }
  // The file offset of the bytes at `p`, or -1 when p is not in this file's mapping.
  int64_t OffsetOf(const std::byte* p) const { return file_->OffsetOf(p); }

 private:
  explicit SafetensorsFile(std::string path) : path_(std::move(path)) {}
  absl::Status Parse();

  std::string path_;
  std::unique_ptr<MappedFile> file_;
  const std::byte* base_ = nullptr;
  size_t size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index in tensors_
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: either model.safetensors.index.json ("weight_map":
// name -> shard file) with its shards, or a single model.safetensors, or (no
// index) every *.safetensors file in the directory. Opens each shard once.
class Checkpoint {
 public:
  // NotFound for a missing/empty directory or a shard missing from the index;
  // InvalidArgument for malformed files, a tensor the index places in a shard
  // that lacks it, or (without index) a tensor name present in two files.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const TensorInfo* Find(std::string_view name) const;  // nullptr if absent
  size_t num_tensors() const { return by_name_.size(); }
  std::vector<std::string> names() const;  // sorted
  // The open file holding tensor `t` (one of Find's) and the offset of its
  // data in it, for a reader that would rather read(2) than fault the mapping
  // in (a page-cached file is read ~4x faster on our 2-core VM); {-1, -1} for
  // a tensor of no file of this checkpoint.
  std::pair<int, int64_t> Locate(const TensorInfo& t) const;

 private:
  Checkpoint() = default;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*, std::less<>> by_name_;
};

struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// Writes a sharded checkpoint into `dir` (created if needed) without buffering
// it in memory: tensors are assigned, in order, to shards holding at most
// max_shard_bytes of tensor data (a larger tensor gets a shard of its own),
// written as model-0000k-of-0000N.safetensors plus model.safetensors.index.json
// (always, even for one shard). fill(i, dst) must produce the bytes of specs[i]
// into dst (zeroed beforehand). `metadata` goes into every shard's
// "__metadata__". Each file is written to a temporary name, fsynced and renamed,
// the index last. InvalidArgument for bad specs (duplicate/reserved names,
// negative dims, size overflow); errno-derived errors for I/O failures.
absl::Status WriteCheckpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                             size_t max_shard_bytes,
                             const std::function<void(size_t, std::span<std::byte>)>& fill,
                             const std::map<std::string, std::string>& metadata = {});

}  // namespace moe
