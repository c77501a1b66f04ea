#include "model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"

namespace moe {

namespace {
// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};
}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  FdCloser fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  std::unique_ptr<MappedFile> f(new MappedFile(path));
  if (st.st_size > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd.fd, 0);
    if (p == MAP_FAILED) return absl::ErrnoToStatus(errno, absl::StrCat("mmap ", path));
    f->base_ = static_cast<const std::byte*>(p);
    f->size_ = static_cast<size_t>(st.st_size);
    ::madvise(p, f->size_, MADV_WILLNEED);
  }
  f->fd_ = fd.fd;  // kept for read(2) (fd()): the file mapped, even if its path is replaced meanwhile
  fd.fd = -1;
  return f;
}

MappedFile::~MappedFile() {
  if (base_ != nullptr) ::munmap(const_cast<std::byte*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

absl::Status AtomicFile::Open() {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  return fd_ < 0 ? absl::ErrnoToStatus(errno, absl::StrCat("create ", tmp_)) : absl::OkStatus();
}

absl::Status AtomicFile::Write(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd_, c, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("write ", tmp_));
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (::fsync(fd_) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", tmp_));
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) return absl::ErrnoToStatus(errno, absl::StrCat("close ", tmp_));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    return absl::ErrnoToStatus(errno, absl::StrCat("rename ", tmp_, " -> ", path_));
  committed_ = true;
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& dir) {
  FdCloser dfd{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dfd.fd < 0 || ::fsync(dfd.fd) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", dir));
  return absl::OkStatus();
}

}  // namespace moe
