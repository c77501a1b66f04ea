#include "model/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/mapped_file.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // same cap as the reference reader
constexpr char kIndexName[] = "model.safetensors.index.json";

// A JSON integer as int64/uint64, or nullopt if it is not an integer in range.
std::optional<int64_t> JsonInt64(const Json& j) {
  if (j.is_number_unsigned()) {
    uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  return std::nullopt;
}
std::optional<uint64_t> JsonUint64(const Json& j) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0) return static_cast<uint64_t>(j.get<int64_t>());
  return std::nullopt;
}

// Byte size of a tensor, or an error for negative dims / overflow.
absl::StatusOr<size_t> ByteSize(DType dtype, std::span<const int64_t> shape) {
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeString(shape)));
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n))
      return absl::InvalidArgumentError(absl::StrCat("size of shape ", ShapeString(shape), " overflows"));
  }
  return n;
}

std::string ShardName(size_t k, size_t n) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, n);
}

}  // namespace

// ---------------------------------------------------------------- SafetensorsFile

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile(path));
  MOE_ASSIGN_OR_RETURN(f->file_, MappedFile::Open(path));
  f->base_ = f->file_->data();
  f->size_ = f->file_->size();
  MOE_RETURN_IF_ERROR(f->Parse());
  return f;
}

SafetensorsFile::~SafetensorsFile() = default;

absl::Status SafetensorsFile::Parse() {
  auto bad = [this](const auto&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", parts...));
  };
  if (size_ < 8) return bad("file too short (", size_, " bytes) to hold a safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(base_[i]);
  if (n > size_ - 8 || n > kMaxHeaderBytes)
    return bad("header length ", n, " exceeds the file size (", size_, " bytes) or the 100 MB limit");
  const char* hdr = reinterpret_cast<const char*>(base_ + 8);
  const Json header = Json::parse(hdr, hdr + n, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return bad("header is not valid JSON");
  if (!header.is_object()) return bad("header JSON is not an object");

  const std::byte* data = base_ + 8 + n;
  const uint64_t data_size = size_ - 8 - n;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return bad("__metadata__ value of '", k, "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad_t = [&](const auto&... parts) { return bad("tensor '", name, "': ", parts...); };
    if (!entry.is_object()) return bad_t("entry is not an object");
    auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) return bad_t("missing or non-string dtype");
    absl::StatusOr<DType> dtype = ParseDType(dt->get_ref<const std::string&>());
    if (!dtype.ok()) return bad_t(dtype.status().message());
    auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array()) return bad_t("missing or non-array shape");
    std::vector<int64_t> shape;
    for (const Json& d : *sh) {
      std::optional<int64_t> v = JsonInt64(d);
      if (!v) return bad_t("shape has a non-integer dimension");
      shape.push_back(*v);
    }
    absl::StatusOr<size_t> nbytes = ByteSize(*dtype, shape);
    if (!nbytes.ok()) return bad_t(nbytes.status().message());
    auto off = entry.find("data_offsets");
    if (off == entry.end() || !off->is_array() || off->size() != 2)
      return bad_t("missing data_offsets or not an array [begin, end]");
    std::optional<uint64_t> begin = JsonUint64((*off)[0]), end = JsonUint64((*off)[1]);
    if (!begin || !end) return bad_t("data_offsets are not non-negative integers");
    if (*begin > *end || *end > data_size)
      return bad_t("data_offsets [", *begin, ",", *end, "] are invalid for a data section of ", data_size,
                   " bytes");
    if (*end - *begin != *nbytes)
      return bad_t("data_offsets span ", *end - *begin, " bytes but ", std::string(DTypeName(*dtype)),
                   ShapeString(shape), " needs ", *nbytes, " (size mismatch)");
    tensors_.push_back({name, *dtype, std::move(shape), data + *begin, *nbytes});
  }

  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.data, a.name) < std::tie(b.data, b.name);
  });
  const TensorInfo* prev = nullptr;  // the non-empty tensor reaching furthest so far
  for (const TensorInfo& t : tensors_) {
    if (t.nbytes == 0) continue;
    if (prev != nullptr && t.data < prev->data + prev->nbytes)
      return bad("tensors '", prev->name, "' and '", t.name, "' overlap");
    prev = &t;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
  return absl::OkStatus();
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------- Checkpoint

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint);

  const std::string index_path = (fs::path(dir) / kIndexName).string();
  if (fs::exists(index_path, ec)) {
    auto bad = [&](const auto&... parts) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": ", parts...));
    };
    std::ifstream in(index_path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) return absl::InternalError(absl::StrCat(index_path, ": cannot read"));
    const Json index = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object()) return bad("not a valid JSON object");
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) return bad("missing or non-object weight_map");
    std::map<std::string, const SafetensorsFile*> shards;
    for (const auto& [name, v] : wm->items()) {
      if (!v.is_string()) return bad("weight_map entry of '", name, "' is not a string");
      const std::string& shard = v.get_ref<const std::string&>();
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos)
        return bad("invalid shard file name '", shard, "'");
      auto it = shards.find(shard);
      if (it == shards.end()) {
        absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
            SafetensorsFile::Open((fs::path(dir) / shard).string());
        if (absl::IsNotFound(f.status()))
          return absl::NotFoundError(absl::StrCat(index_path, ": shard '", shard, "' (holding tensor '",
                                                  name, "') does not exist"));
        if (!f.ok()) return f.status();
        it = shards.emplace(shard, f->get()).first;
        ckpt->files_.push_back(*std::move(f));
      }
      const TensorInfo* t = it->second->Find(name);
      if (t == nullptr) return bad("tensor '", name, "' is mapped to shard '", shard, "' which lacks it");
      ckpt->by_name_.emplace(name, t);
    }
    return ckpt;
  }

  std::vector<fs::path> paths;
  if (fs::path single = fs::path(dir) / "model.safetensors"; fs::exists(single, ec)) {
    paths.push_back(single);
  } else {
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().extension() == ".safetensors") paths.push_back(it->path());
    if (ec) return absl::ErrnoToStatus(ec.value(), absl::StrCat("list ", dir));
    std::sort(paths.begin(), paths.end());
  }
  if (paths.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no safetensors files"));
  for (const fs::path& p : paths) {
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(p.string()));
    for (const TensorInfo& t : f->tensors()) {
      if (auto [it, inserted] = ckpt->by_name_.emplace(t.name, &t); !inserted) {
        auto owner = std::find_if(ckpt->files_.begin(), ckpt->files_.end(),
                                  [&](const auto& g) { return g->Find(t.name) != nullptr; });
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' appears in both ",
                                                       (*owner)->path(), " and ", p.string()));
      }
    }
    ckpt->files_.push_back(std::move(f));
  }
  return ckpt;
}

const TensorInfo* Checkpoint::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::pair<int, int64_t> Checkpoint::Locate(const TensorInfo& t) const {
  for (const auto& f : files_)
    if (const int64_t off = f->OffsetOf(t.data); off >= 0) return {f->fd(), off};
  return {-1, -1};
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& [name, t] : by_name_) out.push_back(name);
  return out;
}

// ---------------------------------------------------------------- WriteCheckpoint

absl::Status WriteCheckpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                             size_t max_shard_bytes,
                             const std::function<void(size_t, std::span<std::byte>)>& fill,
                             const std::map<std::string, std::string>& metadata) {
  // Validate and size every tensor, then plan shards as [first, last) ranges.
  std::vector<size_t> nbytes;
  std::map<std::string_view, size_t> seen;
  uint64_t total = 0;
  for (const TensorSpec& s : specs) {
    if (s.name == "__metadata__") return absl::InvalidArgumentError("tensor name '__metadata__' is reserved");
    if (!seen.emplace(s.name, 0).second)
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", s.name, "'"));
    absl::StatusOr<size_t> n = ByteSize(s.dtype, s.shape);
    if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor '", s.name, "': ", n.status().message()));
    if (__builtin_add_overflow(total, *n, &total))
      return absl::InvalidArgumentError("total checkpoint size overflows");
    nbytes.push_back(*n);
  }
  std::vector<std::pair<size_t, size_t>> shards = {{0, 0}};
  size_t cur = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (cur > 0 && (cur >= max_shard_bytes || nbytes[i] > max_shard_bytes - cur)) {
      shards.push_back({i, i});
      cur = 0;
    }
    shards.back().second = i + 1;
    cur += nbytes[i];
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::ErrnoToStatus(ec.value(), absl::StrCat("create directory ", dir));

  Json weight_map = Json::object();
  std::vector<std::byte> buf;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = ShardName(k, shards.size());
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    uint64_t off = 0;
    for (size_t i = shards[k].first; i < shards[k].second; ++i) {
      header[specs[i].name] = {{"dtype", std::string(DTypeName(specs[i].dtype))},
                               {"shape", specs[i].shape},
                               {"data_offsets", {off, off + nbytes[i]}}};
      off += nbytes[i];
      weight_map[specs[i].name] = name;
    }
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned
    unsigned char len[8];
    for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(static_cast<uint64_t>(h.size()) >> (8 * b));

    AtomicFile out((fs::path(dir) / name).string());
    absl::Status s = out.Open();
    if (s.ok()) s = out.Write(len, sizeof(len));
    if (s.ok()) s = out.Write(h.data(), h.size());
    for (size_t i = shards[k].first; s.ok() && i < shards[k].second; ++i) {
      buf.assign(nbytes[i], std::byte{0});
      fill(i, std::span<std::byte>(buf.data(), buf.size()));
      s = out.Write(buf.data(), buf.size());
    }
    if (s.ok()) s = out.Commit();
    if (!s.ok()) return s;
  }

  Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
  const std::string text = index.dump(2) + "\n";
  AtomicFile out((fs::path(dir) / kIndexName).string());
  absl::Status s = out.Open();
  if (s.ok()) s = out.Write(text.data(), text.size());
  if (s.ok()) s = out.Commit();
  if (!s.ok()) return s;

  return SyncDirectory(dir);  // makes the renames durable
}

}  // namespace moe
