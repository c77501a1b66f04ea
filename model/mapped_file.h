// Files read through a read-only mapping and files written atomically: the
// plumbing every checkpoint format shares (model/safetensors.h, model/gguf.h).
//
// A MappedFile is one regular file mapped read-only (MAP_PRIVATE) with its
// descriptor kept open for read(2); immutable after Open, so any number of
// threads may read it. An AtomicFile is written under "<path>.tmp" and renamed
// to `path` by Commit (fsynced first); one writer thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe {

class MappedFile {
 public:
  // NotFound (errno-derived) when the file cannot be opened; InvalidArgument
  // naming it when it is not a regular file.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();  // munmap, close
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return base_; }  // nullptr for an empty file
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // The open file (read-only; valid while this object lives), for read(2).
  int fd() const { return fd_; }
  // The file offset of the bytes at `p`, or -1 when p is not in the mapping.
  int64_t OffsetOf(const std::byte* p) const {
    return p >= base_ && p < base_ + size_ ? static_cast<int64_t>(p - base_) : -1;
  }

 private:
  explicit MappedFile(std::string path) : path_(std::move(path)) {}
  std::string path_;
  int fd_ = -1;
  const std::byte* base_ = nullptr;
  size_t size_ = 0;
};

// Written to "<path>.tmp", renamed to `path` by Commit; the temporary is
// removed if never committed.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {}
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  absl::Status Open();
  absl::Status Write(const void* p, size_t n);
  // fsync, close, rename.
  absl::Status Commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// fsync of directory `dir`, making renames in it durable.
absl::Status SyncDirectory(const std::string& dir);

}  // namespace moe
