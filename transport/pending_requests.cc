#include "transport/pending_requests.h"

namespace moe {

namespace {
constexpr auto kIdleRecheck = std::chrono::seconds(1);
}  // namespace

void PendingRequests::Group::Complete(const absl::Status& status) {
  bool last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && first_.ok()) first_ = status;
    last = --left_ == 0;
  }
  if (last) done_.set_value(first_);
}

void PendingRequests::Entry::Finish(const absl::Status& status) {
  if (group != nullptr) {
    group->Complete(status);
    group.reset();
  } else {
    done.set_value(status);
  }
}

PendingRequests::PendingRequests() : reaper_([this] { Reap(); }) {}

PendingRequests::~PendingRequests() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (auto& [id, e] : entries_) e.Finish(absl::CancelledError("transport closed"));
    entries_.clear();
  }
  cv_.notify_all();
  reaper_.join();
}

uint64_t PendingRequests::Add(bf16_t* out, int n, uint64_t generation, Clock::time_point deadline,
                              std::future<absl::Status>* future) {
  return AddEntry(out, n, generation, deadline, nullptr, future);
}

uint64_t PendingRequests::AddToGroup(bf16_t* out, int n, uint64_t generation, Clock::time_point deadline,
                                     std::shared_ptr<Group> group) {
  return AddEntry(out, n, generation, deadline, std::move(group), nullptr);
}

uint64_t PendingRequests::AddEntry(bf16_t* out, int n, uint64_t generation, Clock::time_point deadline,
                                   std::shared_ptr<Group> group, std::future<absl::Status>* future) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  Entry& e = entries_[id];
  e.out = out;
  e.n = n;
  e.generation = generation;
  e.deadline = deadline;
  e.group = std::move(group);
  if (future != nullptr) *future = e.done.get_future();
  if (deadline < reaper_wake_) cv_.notify_all();  // the reaper must wake earlier
  return id;
}

std::optional<PendingRequests::Entry> PendingRequests::Take(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  Entry e = std::move(it->second);
  entries_.erase(it);
  return e;
}

void PendingRequests::Complete(uint64_t id, const absl::Status& status) {
  if (std::optional<Entry> e = Take(id)) e->Finish(status);
}

void PendingRequests::FailGeneration(uint64_t generation, const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.generation == generation) {
      it->second.Finish(status);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

size_t PendingRequests::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void PendingRequests::Reap() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto now = Clock::now();
    auto next = Clock::time_point::max();
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.deadline <= now) {
        it->second.Finish(absl::DeadlineExceededError("no answer from the expert server before the deadline"));
        it = entries_.erase(it);
      } else {
        next = std::min(next, it->second.deadline);
        ++it;
      }
    }
    // With nothing pending, look again in a while: a request added meanwhile
    // with a later deadline then needs no wake-up.
    if (next == Clock::time_point::max()) next = now + kIdleRecheck;
    reaper_wake_ = next;  // Add runs only while the reaper waits (it holds mu_ otherwise)
    cv_.wait_until(lock, next);
  }
}

}  // namespace moe
