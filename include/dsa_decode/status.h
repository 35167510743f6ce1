// Error reporting for every public entry point: a Status that is either ok or
// carries a code and a message naming what was wrong. No exceptions cross the
// library boundary and no check vanishes in release builds.
#pragma once

#include <string>
#include <string_view>
#include <utility>

namespace dsa {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // a caller's tensor, shape, dtype, stride or value is wrong
  kUnsupported,      // valid, but not a case this library handles
  kCudaError,        // a CUDA runtime call failed
  kCublasError,      // a cuBLAS / cuBLASLt call failed
  kNoDevice,         // no CUDA device is present
};

const char* error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: argument 'x': expected ..., got ..."
  std::string to_string() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

// "argument '<name>': expected <expected>, got <got>"
Status invalid_argument(std::string_view name, std::string_view expected, std::string_view got);
Status unsupported(std::string message);

}  // namespace dsa

#define DSA_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::dsa::Status dsa_status_ = (expr);        \
    if (!dsa_status_.ok()) return dsa_status_; \
  } while (0)
