// Early-return helpers for absl::Status / absl::StatusOr.
//
//   MOE_RETURN_IF_ERROR(expr);                 // returns expr's Status unless OK
//   MOE_ASSIGN_OR_RETURN(auto x, MakeX());     // declares x = *MakeX() or returns its Status
//   MOE_ASSIGN_OR_RETURN(obj.field, MakeX());  // assigns to an existing lvalue
//
// Usable in functions returning absl::Status or any absl::StatusOr<T>. The
// left-hand side must not contain a top-level comma (wrap such a type in a
// using-declaration first).
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOE_RETURN_IF_ERROR(expr)                                      \
  do {                                                                 \
    if (::absl::Status moe_status_ = (expr); !moe_status_.ok()) {      \
      return moe_status_;                                              \
    }                                                                  \
  } while (0)

#define MOE_STATUS_CONCAT_INNER_(a, b) a##b
#define MOE_STATUS_CONCAT_(a, b) MOE_STATUS_CONCAT_INNER_(a, b)
#define MOE_ASSIGN_OR_RETURN(lhs, rexpr) \
  MOE_ASSIGN_OR_RETURN_IMPL_(MOE_STATUS_CONCAT_(moe_statusor_, __LINE__), lhs, rexpr)
#define MOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                               \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = *std::move(tmp)
