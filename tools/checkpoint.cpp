#include "checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; so must the host be");

namespace dsa::cli {

namespace {

// safetensors' own bound on the header (the reference implementation refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int kMaxJsonDepth = 64;
constexpr int64_t kScaleBlock = 128;  // DeepSeek-V3's FP8 weight blocks: 128 x 128
const char* const kIndexFile = "model.safetensors.index.json";

Status checkpoint_error(const std::string& message) { return Status(ErrorCode::kInvalidArgument, message); }

// ---- A minimal JSON parser: what safetensors headers, their index files and config.json hold ----

struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  std::string text;  // a string's value, or a number as written
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;

  const Json* member(const std::string& key) const {
    for (const auto& [name, value] : members) {
      if (name == key) return &value;
    }
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  // The whole text as one value; false with a message saying where it broke.
  bool parse(Json* value, std::string* error) {
    if (!parse_value(value, 0)) {
      *error = error_ + " at byte " + std::to_string(i_);
      return false;
    }
    skip_space();
    if (i_ != s_.size()) {
      *error = "trailing characters at byte " + std::to_string(i_);
      return false;
    }
    return true;
  }

 private:
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool fail(const std::string& message) {
    if (error_.empty()) error_ = message;
    return false;
  }
  bool literal(const char* word) {
    const size_t n = std::strlen(word);
    if (s_.compare(i_, n, word) != 0) return fail(std::string("expected ") + word);
    i_ += n;
    return true;
  }

  bool parse_value(Json* v, int depth) {
    if (depth > kMaxJsonDepth) return fail("nested too deeply");
    skip_space();
    if (i_ >= s_.size()) return fail("unexpected end");
    const char c = s_[i_];
    if (c == '{') return parse_object(v, depth);
    if (c == '[') return parse_array(v, depth);
    if (c == '"') {
      v->kind = Json::kString;
      return parse_string(&v->text);
    }
    if (c == 't' || c == 'f') {
      v->kind = Json::kBool;
      v->boolean = c == 't';
      return literal(c == 't' ? "true" : "false");
    }
    if (c == 'n') {
      v->kind = Json::kNull;
      return literal("null");
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      const size_t start = i_;
      while (i_ < s_.size() && std::strchr("+-0123456789.eE", s_[i_]) != nullptr) ++i_;
      v->kind = Json::kNumber;
      v->text = s_.substr(start, i_ - start);
      return true;
    }
    return fail(std::string("unexpected character '") + c + "'");
  }

  bool parse_object(Json* v, int depth) {
    v->kind = Json::kObject;
    ++i_;  // {
    skip_space();
    if (i_ < s_.size() && s_[i_] == '}') {
      ++i_;
      return true;
    }
    while (true) {
      skip_space();
      if (i_ >= s_.size() || s_[i_] != '"') return fail("expected a member name");
      std::string key;
      if (!parse_string(&key)) return false;
      skip_space();
      if (i_ >= s_.size() || s_[i_] != ':') return fail("expected ':'");
      ++i_;
      Json value;
      if (!parse_value(&value, depth + 1)) return false;
      v->members.emplace_back(std::move(key), std::move(value));
      skip_space();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        return true;
      }
      return fail("expected ',' or '}'");
    }
  }

  bool parse_array(Json* v, int depth) {
    v->kind = Json::kArray;
    ++i_;  // [
    skip_space();
    if (i_ < s_.size() && s_[i_] == ']') {
      ++i_;
      return true;
    }
    while (true) {
      Json item;
      if (!parse_value(&item, depth + 1)) return false;
      v->items.push_back(std::move(item));
      skip_space();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        return true;
      }
      return fail("expected ',' or ']'");
    }
  }

  static void append_utf8(uint32_t code, std::string* out) {
    if (code < 0x80) {
      out->push_back(char(code));
    } else if (code < 0x800) {
      out->push_back(char(0xC0 | (code >> 6)));
      out->push_back(char(0x80 | (code & 0x3F)));
    } else if (code < 0x10000) {
      out->push_back(char(0xE0 | (code >> 12)));
      out->push_back(char(0x80 | ((code >> 6) & 0x3F)));
      out->push_back(char(0x80 | (code & 0x3F)));
    } else {
      out->push_back(char(0xF0 | (code >> 18)));
      out->push_back(char(0x80 | ((code >> 12) & 0x3F)));
      out->push_back(char(0x80 | ((code >> 6) & 0x3F)));
      out->push_back(char(0x80 | (code & 0x3F)));
    }
  }

  bool hex4(uint32_t* code) {
    if (i_ + 4 > s_.size()) return fail("short \\u escape");
    *code = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      *code <<= 4;
      if (h >= '0' && h <= '9') *code |= uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f') *code |= uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') *code |= uint32_t(h - 'A' + 10);
      else return fail("bad \\u escape");
    }
    return true;
  }

  bool parse_string(std::string* out) {
    ++i_;  // "
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return fail("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (i_ >= s_.size()) break;
      const char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out->push_back(e); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t code = 0;
          if (!hex4(&code)) return false;
          if (code >= 0xD800 && code < 0xDC00 && i_ + 1 < s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') {
            i_ += 2;
            uint32_t low = 0;
            if (!hex4(&low)) return false;
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(code, out);
          break;
        }
        default: return fail(std::string("bad escape '\\") + e + "'");
      }
    }
    return fail("unterminated string");
  }

  const std::string& s_;
  size_t i_ = 0;
  std::string error_;
};

bool json_uint64(const Json& v, uint64_t* out) {
  if (v.kind != Json::kNumber) return false;
  const char* end = v.text.data() + v.text.size();
  const auto [stop, code] = std::from_chars(v.text.data(), end, *out);
  return code == std::errc() && stop == end;
}

std::string json_quote(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof(escape), "\\u%04x", static_cast<unsigned>(c));
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// ---- Files ----

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool file_exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

std::string join_path(const std::string& directory, const std::string& name) {
  if (directory.empty() || directory.back() == '/') return directory + name;
  return directory + "/" + name;
}

std::string parent_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
}

bool read_text_file(const std::string& path, std::string* text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  *text = buffer.str();
  return static_cast<bool>(in) || in.eof();
}

bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

// pread of exactly `count` bytes; false on a short read.
bool read_exactly(int fd, uint64_t offset, uint64_t count, void* into) {
  char* out = static_cast<char*>(into);
  while (count > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(count, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, out, chunk, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    out += got;
    offset += uint64_t(got);
    count -= uint64_t(got);
  }
  return true;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Sizes `v` to `count` elements, asking the kernel for transparent huge
// pages first where the allocation is large: the load's time is mostly the
// first touch of fresh memory (a page fault and a clear per 4 KB page
// otherwise), not the copy from the file.
template <class T>
void size_for_reading(std::vector<T>* v, size_t count) {
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  v->clear();
  v->shrink_to_fit();
  v->reserve(count);
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(v->data()) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(v->data()) + count * sizeof(T)) & ~(kHugePage - 1);
#ifdef MADV_HUGEPAGE
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice only
#endif
  v->resize(count);
}

// e4m3 code -> FP32, all 256 codes.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) value[c] = num::e4m3_to_float(static_cast<uint8_t>(c));
  }
};
const E4m3Table& e4m3_table() {
  static const E4m3Table table;
  return table;
}

}  // namespace

// ---- SafeTensor, Checkpoint ----

int64_t SafeTensor::elements() const {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  return count;
}

std::string SafeTensor::shape_text() const { return shape_string(shape); }

int safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "BOOL" || dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  return 0;
}

Status Checkpoint::add_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return checkpoint_error("checkpoint file " + path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat info {};
  ::fstat(fd, &info);
  const uint64_t file_size = uint64_t(info.st_size);
  uint8_t length_bytes[8];
  const bool length_read = file_size >= 8 && read_exactly(fd, 0, 8, length_bytes);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  std::string header;
  const auto close_with = [fd](Status status) {
    ::close(fd);
    return status;
  };
  const std::string where = "checkpoint file " + path;
  if (!length_read) return close_with(checkpoint_error(where + ": bad header (shorter than its 8-byte length)"));
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_size - 8) {
    return close_with(checkpoint_error(where + ": bad header (length " + std::to_string(header_bytes) +
                                       " bytes, the file has " + std::to_string(file_size) + "): truncated or not safetensors"));
  }
  header.resize(header_bytes);
  if (!read_exactly(fd, 8, header_bytes, header.data())) {
    return close_with(checkpoint_error(where + ": bad header (could not read it)"));
  }
  ::close(fd);
  Json root;
  std::string error;
  if (!JsonParser(header).parse(&root, &error)) return checkpoint_error(where + ": bad header (JSON: " + error + ")");
  if (root.kind != Json::kObject) return checkpoint_error(where + ": bad header (not a JSON object)");
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = file_size - data_start;
  std::vector<std::string> problems;
  for (const auto& [name, entry] : root.members) {
    if (name == "__metadata__") continue;
    const Json* dtype = entry.member("dtype");
    const Json* shape = entry.member("shape");
    const Json* offsets = entry.member("data_offsets");
    SafeTensor t;
    t.name = name;
    t.file = path;
    bool ok = entry.kind == Json::kObject && dtype != nullptr && dtype->kind == Json::kString && shape != nullptr &&
              shape->kind == Json::kArray && offsets != nullptr && offsets->kind == Json::kArray &&
              offsets->items.size() == 2;
    uint64_t begin = 0, end = 0;
    if (ok) {
      t.dtype = dtype->text;
      for (const Json& d : shape->items) {
        uint64_t extent = 0;
        ok = ok && json_uint64(d, &extent) && extent < (uint64_t{1} << 40);
        t.shape.push_back(int64_t(extent));
      }
      ok = ok && json_uint64(offsets->items[0], &begin) && json_uint64(offsets->items[1], &end) && begin <= end;
    }
    if (!ok) {
      problems.push_back(name + ": bad header entry (expected {\"dtype\": string, \"shape\": [integers], "
                                "\"data_offsets\": [begin, end]})");
      continue;
    }
    t.offset = data_start + begin;
    t.bytes = end - begin;
    const int size = safetensors_dtype_size(t.dtype);
    if (size > 0 && uint64_t(t.elements()) * uint64_t(size) != t.bytes) {
      problems.push_back(name + ": data_offsets span " + std::to_string(t.bytes) + " bytes, but " + t.dtype + " " +
                         t.shape_text() + " is " + std::to_string(uint64_t(t.elements()) * uint64_t(size)) + " bytes");
      continue;
    }
    if (end > data_bytes) {
      problems.push_back(name + ": data [" + std::to_string(begin) + ", " + std::to_string(end) +
                         ") runs past the end of the file's " + std::to_string(data_bytes) +
                         " data bytes (truncated file)");
      continue;
    }
    if (const auto [it, inserted] = tensors_.emplace(name, t); !inserted) {
      problems.push_back(name + ": in two files, " + it->second.file + " and " + path);
    }
  }
  files_.push_back(path);
  if (!problems.empty()) {
    std::string message = where + ": " + std::to_string(problems.size()) + " bad tensor entr" +
                          (problems.size() == 1 ? "y" : "ies") + ":";
    for (const std::string& p : problems) message += "\n  " + p;
    return checkpoint_error(message);
  }
  return Status();
}

Status Checkpoint::open(const std::vector<std::string>& paths, const std::vector<std::string>& wanted, Checkpoint* out) {
  *out = Checkpoint();
  if (paths.empty()) return checkpoint_error("--weights: no checkpoint path given");
  std::vector<std::string> files;
  std::string config_directory;
  if (paths.size() == 1 && is_directory(paths[0])) {
    const std::string& directory = paths[0];
    config_directory = directory;
    const std::string index_path = join_path(directory, kIndexFile);
    if (file_exists(index_path)) {
      std::string text, error;
      Json index;
      if (!read_text_file(index_path, &text)) return checkpoint_error(index_path + ": cannot read");
      if (!JsonParser(text).parse(&index, &error)) return checkpoint_error(index_path + ": bad JSON (" + error + ")");
      const Json* map = index.member("weight_map");
      if (map == nullptr || map->kind != Json::kObject) {
        return checkpoint_error(index_path + ": no \"weight_map\" object");
      }
      const std::set<std::string> wanted_set(wanted.begin(), wanted.end());
      std::set<std::string> chosen;
      std::vector<std::string> problems;
      for (const auto& [name, file] : map->members) {
        out->indexed_.insert(name);
        if (!wanted_set.empty() && wanted_set.count(name) == 0) continue;
        if (file.kind != Json::kString || file.text.empty() || file.text.find('/') != std::string::npos) {
          problems.push_back(name + ": the weight_map names no file in the directory");
          continue;
        }
        const std::string shard = join_path(directory, file.text);
        if (!file_exists(shard)) {
          problems.push_back(name + ": in " + file.text + ", which is not in " + directory);
          continue;
        }
        if (chosen.insert(shard).second) files.push_back(shard);
      }
      if (!problems.empty()) {
        std::string message = index_path + ": " + std::to_string(problems.size()) + " tensors not readable:";
        for (const std::string& p : problems) message += "\n  " + p;
        return checkpoint_error(message);
      }
    } else {
      DIR* dir = ::opendir(directory.c_str());
      if (dir == nullptr) return checkpoint_error("--weights: cannot list directory " + directory);
      while (const dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (ends_with(name, ".safetensors")) files.push_back(join_path(directory, name));
      }
      ::closedir(dir);
      std::sort(files.begin(), files.end());
      if (files.empty()) {
        return checkpoint_error("--weights: directory " + directory + " holds neither " + kIndexFile +
                                " nor any .safetensors file");
      }
    }
  } else {
    for (const std::string& path : paths) {
      if (is_directory(path)) {
        return checkpoint_error("--weights: " + path + " is a directory; give one directory or a list of files");
      }
      files.push_back(path);
    }
    config_directory = parent_directory(paths[0]);
  }
  for (const std::string& file : files) DSA_RETURN_IF_ERROR(out->add_file(file));
  const std::string config_path = join_path(config_directory, "config.json");
  if (file_exists(config_path)) read_text_file(config_path, &out->config_json_);
  return Status();
}

const SafeTensor* Checkpoint::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Status Checkpoint::read(const SafeTensor& tensor, uint64_t first, uint64_t count, void* into) const {
  if (first + count > tensor.bytes) {
    return checkpoint_error(tensor.name + ": read of bytes [" + std::to_string(first) + ", " +
                            std::to_string(first + count) + ") past its " + std::to_string(tensor.bytes));
  }
  const int fd = ::open(tensor.file.c_str(), O_RDONLY);
  if (fd < 0) return checkpoint_error(tensor.name + ": cannot open " + tensor.file + " (" + std::strerror(errno) + ")");
  const bool ok = read_exactly(fd, tensor.offset + first, count, into);
  ::close(fd);
  if (!ok) return checkpoint_error(tensor.name + ": short read from " + tensor.file + " (truncated file)");
  bytes_read_ += count;
  return Status();
}

Status Checkpoint::read_rows(const SafeTensor& tensor, uint64_t rows, uint64_t stride, uint64_t row_bytes,
                             void* into) const {
  if (row_bytes == stride) return read(tensor, 0, rows * stride, into);
  if (row_bytes > stride || (rows > 0 && (rows - 1) * stride + row_bytes > tensor.bytes)) {
    return checkpoint_error(tensor.name + ": read of " + std::to_string(rows) + " rows past its " +
                            std::to_string(tensor.bytes) + " bytes");
  }
  const int fd = ::open(tensor.file.c_str(), O_RDONLY);
  if (fd < 0) return checkpoint_error(tensor.name + ": cannot open " + tensor.file + " (" + std::strerror(errno) + ")");
  bool ok = true;
  for (uint64_t r = 0; r < rows && ok; ++r) {
    ok = read_exactly(fd, tensor.offset + r * stride, row_bytes, static_cast<char*>(into) + r * row_bytes);
  }
  ::close(fd);
  if (!ok) return checkpoint_error(tensor.name + ": short read from " + tensor.file + " (truncated file)");
  bytes_read_ += rows * row_bytes;
  return Status();
}

// ---- config.json ----

namespace {

// The whole of a JSON number's text as an int, or why not ("a string", "1.5", ...).
bool json_int(const Json& v, int* out, std::string* got) {
  switch (v.kind) {
    case Json::kNull:
      *got = "null";
      return false;
    case Json::kBool:
      *got = v.boolean ? "true" : "false";
      return false;
    case Json::kString:
      *got = json_quote(v.text);
      return false;
    case Json::kArray:
      *got = "an array";
      return false;
    case Json::kObject:
      *got = "an object";
      return false;
    case Json::kNumber:
      break;
  }
  const char* end = v.text.data() + v.text.size();
  const auto [stop, code] = std::from_chars(v.text.data(), end, *out);
  *got = v.text;
  return code == std::errc() && stop == end;
}

}  // namespace

Status parse_model_config(const std::string& text, const std::string& where, ModelConfig* out) {
  Json root;
  std::string error;
  if (!JsonParser(text).parse(&root, &error)) return checkpoint_error(where + ": bad JSON (" + error + ")");
  if (root.kind != Json::kObject) return checkpoint_error(where + ": not a JSON object");
  const Json* fields = &root;
  if (root.member("index_n_heads") == nullptr) {
    const Json* text_config = root.member("text_config");
    if (text_config != nullptr && text_config->kind == Json::kObject && text_config->member("index_n_heads") != nullptr) {
      fields = text_config;
    }
  }
  ModelConfig c;
  c.path = where;
  std::vector<std::string> missing, problems;
  // A present integer field: its value, or a problem naming it.
  const auto integer = [&](const char* name, bool required, int* value) {
    const Json* v = fields->member(name);
    if (v == nullptr) {
      if (required) missing.push_back(name);
      return false;
    }
    std::string got;
    if (!json_int(*v, value, &got)) {
      problems.push_back(std::string(name) + ": expected an integer, got " + got);
      return false;
    }
    return true;
  };
  const auto must = [&](const char* name, bool ok, const std::string& expected, int value) {
    if (!ok) problems.push_back(std::string(name) + ": expected " + expected + ", got " + std::to_string(value));
    return ok;
  };
  if (integer("index_n_heads", true, &c.index_n_heads)) {
    must("index_n_heads", c.index_n_heads == 16 || c.index_n_heads == 32 || c.index_n_heads == 64, "16, 32 or 64",
         c.index_n_heads);
  }
  const bool pool_ok = integer("index_kpool", true, &c.index_kpool) &&
                       must("index_kpool", c.index_kpool == 4 || c.index_kpool == 8 || c.index_kpool == 16,
                            "4, 8 or 16", c.index_kpool);
  if (integer("index_topk", true, &c.index_topk)) {
    if (pool_ok) {
      must("index_topk",
           c.index_topk >= c.index_kpool && c.index_topk % c.index_kpool == 0 &&
               c.index_topk / c.index_kpool <= kIndexerMaxTopPools,
           "a multiple of index_kpool = " + std::to_string(c.index_kpool) + " from " + std::to_string(c.index_kpool) +
               " to " + std::to_string(kIndexerMaxTopPools * c.index_kpool),
           c.index_topk);
    } else {
      must("index_topk", c.index_topk > 0, "a positive multiple of index_kpool", c.index_topk);
    }
  }
  if (integer("index_head_dim", true, &c.index_head_dim)) {
    must("index_head_dim", c.index_head_dim == kIndexerDim, std::to_string(kIndexerDim), c.index_head_dim);
  }
  const auto optional = [&](const char* name, std::optional<int>* field, const std::string& expected,
                            bool (*ok)(int)) {
    int value = 0;
    if (integer(name, false, &value) && must(name, ok(value), expected, value)) *field = value;
  };
  optional("hidden_size", &c.hidden_size, "a positive multiple of 8", [](int v) { return v > 0 && v % 8 == 0; });
  optional("num_attention_heads", &c.num_attention_heads, "1 to 1024 heads", [](int v) { return v >= 1 && v <= 1024; });
  optional("q_lora_rank", &c.q_lora_rank, "a positive multiple of 8, at least kv_lora_rank (512)",
           [](int v) { return v >= 512 && v % 8 == 0; });
  optional("kv_lora_rank", &c.kv_lora_rank, "512 (the attention's latent)", [](int v) { return v == 512; });
  optional("qk_nope_head_dim", &c.qk_nope_head_dim, "a positive integer", [](int v) { return v > 0; });
  optional("qk_rope_head_dim", &c.qk_rope_head_dim, "0 (NoPE: the stage runs no RoPE)", [](int v) { return v == 0; });
  optional("v_head_dim", &c.v_head_dim, "a positive integer", [](int v) { return v > 0; });
  if (!missing.empty() || !problems.empty()) {
    std::string message = where + ": ";
    if (!missing.empty()) {
      message += "missing field" + std::string(missing.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < missing.size(); ++i) message += (i ? ", " : "") + missing[i];
      if (!problems.empty()) message += "; ";
    }
    for (size_t i = 0; i < problems.size(); ++i) message += (i ? "; " : "") + problems[i];
    return checkpoint_error(message);
  }
  *out = std::move(c);
  return Status();
}

Status read_model_config(const std::string& path, ModelConfig* out) {
  const std::string file = is_directory(path) ? join_path(path, "config.json") : path;
  std::string text;
  if (!file_exists(file) || !read_text_file(file, &text)) {
    return checkpoint_error(file + ": cannot read it (a config.json, or a directory holding one)");
  }
  return parse_model_config(text, file, out);
}

Status apply_model_config(const ModelPreset& preset, const ModelConfig& c, ModelPreset* out) {
  ModelPreset p{};
  const Status shaped = with_indexer_shape(preset, c.index_n_heads, c.index_kpool, c.index_topk, &p);
  if (!shaped.ok()) return checkpoint_error(c.path + ": " + shaped.message());
  if (c.hidden_size) p.hidden = *c.hidden_size;
  if (c.num_attention_heads) p.heads = *c.num_attention_heads;
  if (c.q_lora_rank) p.q_lora = *c.q_lora_rank;
  if (c.kv_lora_rank) p.kv_lora = *c.kv_lora_rank;
  if (c.qk_nope_head_dim) p.qk_nope = *c.qk_nope_head_dim;
  if (c.qk_rope_head_dim) p.qk_rope = *c.qk_rope_head_dim;
  if (c.v_head_dim) p.v_head = *c.v_head_dim;
  if (c.qk_nope_head_dim || c.qk_rope_head_dim) {
    p.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(p.qk_nope + p.qk_rope)));
  }
  *out = p;
  return Status();
}

std::vector<std::string> split_weight_paths(const std::string& weights) {
  std::vector<std::string> paths;
  for (size_t start = 0; start <= weights.size();) {
    const size_t comma = std::min(weights.find(',', start), weights.size());
    if (comma > start) paths.push_back(weights.substr(start, comma - start));
    start = comma + 1;
  }
  return paths;
}

std::string layer_tensor_name(int layer, const std::string& suffix) {
  return "model.layers." + std::to_string(layer) + ".self_attn." + suffix;
}

std::vector<uint16_t> dequantize_fp8_blocks(const uint8_t* codes, const float* scale_inv, int64_t rows, int64_t cols) {
  const E4m3Table& table = e4m3_table();
  const int64_t scale_cols = (cols + kScaleBlock - 1) / kScaleBlock;
  std::vector<uint16_t> out;
  size_for_reading(&out, size_t(rows) * size_t(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* scales = scale_inv + (r / kScaleBlock) * scale_cols;
    const uint8_t* in = codes + r * cols;
    uint16_t* o = out.data() + r * cols;
    for (int64_t block = 0; block * kScaleBlock < cols; ++block) {
      const float scale = scales[block];
      const int64_t end = std::min(cols, (block + 1) * kScaleBlock);
      for (int64_t c = block * kScaleBlock; c < end; ++c) o[c] = num::float_to_bf16(table.value[in[c]] * scale);
    }
  }
  return out;
}

// ---- The layer ----

namespace {

// One tensor the layer needs: its Hugging Face name's suffix under
// model.layers.N.self_attn. and its shape in the whole model.
struct Needed {
  std::string suffix;
  std::vector<int64_t> shape;
  bool projection;  // 2-D: may be F8_E4M3 with block scales
};

std::vector<Needed> needed_tensors(const StepShape& s) {
  const int64_t heads = int64_t{s.H} * s.tp;  // the whole model's
  const int64_t D = s.D, Q = s.Q, L = s.L, P = s.P, V = s.V;
  return {
      {"q_a_proj.weight", {Q, D}, true},
      {"q_a_layernorm.weight", {Q}, false},
      {"q_b_proj.weight", {heads * P, Q}, true},
      {"kv_a_proj_with_mqa.weight", {L, D}, true},
      {"kv_a_layernorm.weight", {L}, false},
      {"kv_b_proj.weight", {heads * (P + V), L}, true},
      {"o_proj.weight", {D, heads * V}, true},
      {"indexer.wq_b.weight", {int64_t{s.index_heads} * kIndexerDim, Q}, true},
      {"indexer.wk.weight", {kIndexerDim, D}, true},
      {"indexer.weights_proj.weight", {s.index_heads, D}, true},
      {"indexer.k_norm.weight", {kIndexerDim}, false},
      {"indexer.k_norm.bias", {kIndexerDim}, false},
      {"indexer.index_kpool_compress_gate", {kIndexerDim, D}, true},
      {"indexer.index_kpool_compress_ape", {s.index_pool, kIndexerDim}, false},
  };
}

std::vector<int64_t> scale_shape(const std::vector<int64_t>& shape) {
  return {(shape[0] + kScaleBlock - 1) / kScaleBlock, (shape[1] + kScaleBlock - 1) / kScaleBlock};
}

class LayerReader {
 public:
  LayerReader(const Checkpoint& checkpoint, int layer, CheckpointLoad* load)
      : c_(checkpoint), layer_(layer), load_(load) {}

  const SafeTensor& tensor(const std::string& suffix) const { return *c_.find(layer_tensor_name(layer_, suffix)); }

  // Rows [0, rows) and columns [0, cols) of the (checked) tensor `suffix`
  // (cols < 0: all of them; a 1-D tensor is one column), as BF16.
  Status bf16_block(const std::string& suffix, int64_t rows, int64_t cols, std::vector<uint16_t>* out) const {
    const SafeTensor& t = tensor(suffix);
    const int64_t width = t.shape.size() == 2 ? t.shape[1] : 1;
    if (cols < 0) cols = width;
    const size_t count = size_t(rows) * size_t(cols);
    ++load_->tensors;
    if (t.dtype == "BF16") {
      size_for_reading(out, count);
      return c_.read_rows(t, uint64_t(rows), uint64_t(width) * 2, uint64_t(cols) * 2, out->data());
    }
    if (t.dtype == "F32") {
      std::vector<float> values;
      size_for_reading(&values, count);
      DSA_RETURN_IF_ERROR(c_.read_rows(t, uint64_t(rows), uint64_t(width) * 4, uint64_t(cols) * 4, values.data()));
      size_for_reading(out, count);
      for (size_t i = 0; i < count; ++i) (*out)[i] = num::float_to_bf16(values[i]);
      return Status();
    }
    // F8_E4M3 (checked): the codes of the block and the scales of the 128 x 128 blocks it touches.
    const SafeTensor& scales = *c_.find(t.name + "_scale_inv");
    const int64_t scale_rows = (rows + kScaleBlock - 1) / kScaleBlock;
    const int64_t scale_cols = (cols + kScaleBlock - 1) / kScaleBlock;
    std::vector<uint8_t> codes;
    size_for_reading(&codes, count);
    std::vector<float> scale(size_t(scale_rows) * size_t(scale_cols));
    DSA_RETURN_IF_ERROR(c_.read_rows(t, uint64_t(rows), uint64_t(width), uint64_t(cols), codes.data()));
    DSA_RETURN_IF_ERROR(c_.read_rows(scales, uint64_t(scale_rows), uint64_t(scales.shape[1]) * 4,
                                     uint64_t(scale_cols) * 4, scale.data()));
    *out = dequantize_fp8_blocks(codes.data(), scale.data(), rows, cols);
    ++load_->fp8_tensors;
    return Status();
  }

  Status bf16_rows(const std::string& suffix, int64_t rows, std::vector<uint16_t>* out) const {
    return bf16_block(suffix, rows, -1, out);
  }

  Status bf16_all(const std::string& suffix, std::vector<uint16_t>* out) const {
    return bf16_rows(suffix, tensor(suffix).shape[0], out);
  }

  // The whole tensor as FP32 (F32 kept as it is; BF16 exact; FP8 its BF16 dequantization).
  Status floats(const std::string& suffix, std::vector<float>* out) const {
    const SafeTensor& t = tensor(suffix);
    if (t.dtype == "F32") {
      ++load_->tensors;
      out->resize(size_t(t.elements()));
      return c_.read(t, 0, t.bytes, out->data());
    }
    std::vector<uint16_t> values;
    DSA_RETURN_IF_ERROR(bf16_all(suffix, &values));
    out->resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) (*out)[i] = num::bf16_to_float(values[i]);
    return Status();
  }

 private:
  const Checkpoint& c_;
  int layer_;
  CheckpointLoad* load_;
};

// Every problem with the layer's tensors, one line each (empty: none).
std::vector<std::string> check_tensors(const Checkpoint& c, int layer, const std::vector<Needed>& needed) {
  std::vector<std::string> problems;
  for (const Needed& n : needed) {
    const std::string name = layer_tensor_name(layer, n.suffix);
    const SafeTensor* t = c.find(name);
    if (t == nullptr) {
      problems.push_back(name + ": missing (expected " + shape_string(n.shape) + ")");
      continue;
    }
    const bool fp8 = t->dtype == "F8_E4M3";
    if (t->dtype != "BF16" && t->dtype != "F32" && !(fp8 && n.projection)) {
      problems.push_back(name + ": dtype " + t->dtype + ", expected BF16, F32" +
                         (n.projection ? " or F8_E4M3 with 128 x 128 block scales" : ""));
    }
    if (t->shape != n.shape) {
      problems.push_back(name + ": shape " + t->shape_text() + ", expected " + shape_string(n.shape));
      continue;
    }
    if (!fp8 || !n.projection) continue;
    const std::string scale_name = name + "_scale_inv";
    const SafeTensor* scale = c.find(scale_name);
    const std::vector<int64_t> expected = scale_shape(n.shape);
    if (scale == nullptr) {
      problems.push_back(scale_name + ": missing (the F32 " + shape_string(expected) + " block scales of F8_E4M3 " +
                         name + ")");
    } else if (scale->dtype != "F32" || scale->shape != expected) {
      problems.push_back(scale_name + ": " + scale->dtype + " " + scale->shape_text() + ", expected F32 " +
                         shape_string(expected) + " (the 128 x 128 block scales of " + name + ")");
    }
  }
  return problems;
}

// The layers the checkpoint holds attention tensors of: "0, 1, 3" or "none".
std::string layers_present(const Checkpoint& c, const std::vector<Needed>& needed) {
  std::set<int> layers;
  for (int layer = 0; layer < 1000; ++layer) {
    const std::string name = layer_tensor_name(layer, needed[0].suffix);
    if (c.find(name) != nullptr || c.indexes(name)) layers.insert(layer);
  }
  std::string text;
  for (int l : layers) text += (text.empty() ? "" : ", ") + std::to_string(l);
  return text.empty() ? "none" : text;
}

}  // namespace

Status load_layer_weights(const std::vector<std::string>& paths, int layer, const StepShape& s, HostWeights* out,
                          CheckpointLoad* load) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  *load = CheckpointLoad();
  if (s.per_rank.qk_rope != 0) return unsupported("checkpoint layers of RoPE presets are not supported yet");
  const std::vector<Needed> needed = needed_tensors(s);
  std::vector<std::string> wanted;
  for (const Needed& n : needed) {
    wanted.push_back(layer_tensor_name(layer, n.suffix));
    wanted.push_back(wanted.back() + "_scale_inv");
  }
  Checkpoint c;
  DSA_RETURN_IF_ERROR(Checkpoint::open(paths, wanted, &c));
  load->files = c.file_count();
  if (const std::vector<std::string> problems = check_tensors(c, layer, needed); !problems.empty()) {
    std::string joined;
    for (const std::string& p : paths) joined += (joined.empty() ? "" : ",") + p;
    std::string message = "checkpoint " + joined + ", layer " + std::to_string(layer) + " at " + s.describe() +
                          " (the whole model's " + std::to_string(s.H * s.tp) + " heads): " +
                          std::to_string(problems.size()) + " tensor problem" + (problems.size() == 1 ? "" : "s") + ":";
    for (const std::string& p : problems) message += "\n  " + p;
    message += "\n(layers with attention tensors in the checkpoint: " + layers_present(c, needed) + ")";
    return checkpoint_error(message);
  }

  const LayerReader r(c, layer, load);
  const int64_t H = s.H, P = s.P, V = s.V, L = s.L, D = s.D;
  HostWeights w;
  // fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa], vLLM's MergedColumnParallelLinear (replicated).
  std::vector<uint16_t> kv_a;
  DSA_RETURN_IF_ERROR(r.bf16_all("q_a_proj.weight", &w.fused_qkv_a_proj));
  DSA_RETURN_IF_ERROR(r.bf16_all("kv_a_proj_with_mqa.weight", &kv_a));
  w.fused_qkv_a_proj.insert(w.fused_qkv_a_proj.end(), kv_a.begin(), kv_a.end());
  DSA_RETURN_IF_ERROR(r.bf16_all("q_a_layernorm.weight", &w.q_norm_gamma));
  DSA_RETURN_IF_ERROR(r.bf16_all("kv_a_layernorm.weight", &w.kv_norm_gamma));
  // Column-parallel: rank 0 holds the first H heads' output rows.
  DSA_RETURN_IF_ERROR(r.bf16_rows("q_b_proj.weight", H * P, &w.q_b_proj));
  std::vector<uint16_t> kv_b;  // [H * (P + V), L]: per head P rows of W_UK, then V rows of W_UV
  DSA_RETURN_IF_ERROR(r.bf16_rows("kv_b_proj.weight", H * (P + V), &kv_b));
  size_for_reading(&w.w_uk_t, size_t(H * P * L));
  size_for_reading(&w.w_uv, size_t(H * L * V));
  for (int64_t h = 0; h < H; ++h) {
    const uint16_t* head = kv_b.data() + h * (P + V) * L;
    // W_UK_T[h, p, l] = kv_b[h (P + V) + p, l]: the rows as they are.
    std::copy_n(head, P * L, w.w_uk_t.data() + h * P * L);
    // W_UV[h, l, v] = kv_b[h (P + V) + P + v, l]: transposed.
    uint16_t* uv = w.w_uv.data() + h * L * V;
    for (int64_t v = 0; v < V; ++v) {
      const uint16_t* row = head + (P + v) * L;
      for (int64_t l = 0; l < L; ++l) uv[l * V + v] = row[l];
    }
  }
  // Row-parallel: rank 0 holds the first H * V input columns of every row.
  DSA_RETURN_IF_ERROR(r.bf16_block("o_proj.weight", D, H * V, &w.o_proj));
  // The indexer: replicated on every rank.
  DSA_RETURN_IF_ERROR(r.bf16_all("indexer.wq_b.weight", &w.index_wq_b));
  DSA_RETURN_IF_ERROR(r.bf16_all("indexer.wk.weight", &w.index_wk));
  DSA_RETURN_IF_ERROR(r.bf16_all("indexer.weights_proj.weight", &w.index_weights_proj));
  DSA_RETURN_IF_ERROR(r.bf16_all("indexer.index_kpool_compress_gate", &w.index_compress_gate));
  DSA_RETURN_IF_ERROR(r.floats("indexer.k_norm.weight", &w.index_k_norm_weight));
  DSA_RETURN_IF_ERROR(r.floats("indexer.k_norm.bias", &w.index_k_norm_bias));
  DSA_RETURN_IF_ERROR(r.floats("indexer.index_kpool_compress_ape", &w.index_ape));

  // The scales and eps the checkpoint does not hold: the synthetic layer's.
  const HostWeights synthetic = make_weights(StepShape{}, 0);
  w.q_scale = synthetic.q_scale;
  w.k_scale = synthetic.k_scale;
  w.eps = synthetic.eps;
  load->eps_source = "the synthetic layer's (no config.json beside the files)";
  if (!c.config_json().empty()) {
    Json config;
    std::string error;
    const Json* eps = nullptr;
    double value = 0;
    if (JsonParser(c.config_json()).parse(&config, &error) && (eps = config.member("rms_norm_eps")) != nullptr &&
        eps->kind == Json::kNumber && (value = std::strtod(eps->text.c_str(), nullptr)) > 0) {
      w.eps = static_cast<float>(value);
      load->eps_source = "config.json's rms_norm_eps";
    } else {
      load->eps_source = "the synthetic layer's (config.json has no rms_norm_eps)";
    }
  }
  *out = std::move(w);
  load->bytes = c.bytes_read();
  load->seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return Status();
}

Status build_layer_weights(const StepShape& s, const std::string& weights, int layer, uint64_t seed, HostWeights* out,
                           std::string* what) {
  char text[4096];
  if (weights.empty()) {
    *out = make_weights(s, seed);
    std::snprintf(text, sizeof(text), "synthetic layer (seed %llu)", static_cast<unsigned long long>(seed));
    *what = text;
    return Status();
  }
  CheckpointLoad load;
  DSA_RETURN_IF_ERROR(load_layer_weights(split_weight_paths(weights), layer, s, out, &load));
  std::snprintf(text, sizeof(text),
                "checkpoint layer %d of %s (rank 0 of TP%d; %zu tensors from %zu file%s, %zu dequantized from FP8 "
                "blocks; %.1f MB read in %.3f s: %.2f GB/s; eps %g from %s; q_scale, k_scale the synthetic "
                "layer's)",
                layer, weights.c_str(), s.tp, load.tensors, load.files, load.files == 1 ? "" : "s", load.fp8_tensors,
                load.bytes / 1e6, load.seconds, load.gb_per_s(), out->eps, load.eps_source.c_str());
  *what = text;
  return Status();
}

// ---- Writing ----

Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    header += "," + json_quote(t.name) + ":{\"dtype\":" + json_quote(t.dtype) + ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.data.size()) + "]}";
    offset += t.data.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';  // the data 8-byte aligned, as safetensors pads it
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return checkpoint_error(path + ": cannot create (" + std::strerror(errno) + ")");
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  bool ok = std::fwrite(length, 1, 8, file) == 8 && std::fwrite(header.data(), 1, header.size(), file) == header.size();
  for (const TensorToWrite& t : tensors) {
    ok = ok && (t.data.empty() || std::fwrite(t.data.data(), 1, t.data.size(), file) == t.data.size());
  }
  ok = std::fclose(file) == 0 && ok;
  return ok ? Status() : checkpoint_error(path + ": write failed");
}

Status write_safetensors_index(const std::string& directory, const std::map<std::string, std::string>& weight_map) {
  std::string text = "{\n  \"metadata\": {},\n  \"weight_map\": {";
  bool first = true;
  for (const auto& [name, file] : weight_map) {
    text += std::string(first ? "\n" : ",\n") + "    " + json_quote(name) + ": " + json_quote(file);
    first = false;
  }
  text += "\n  }\n}\n";
  const std::string path = join_path(directory, kIndexFile);
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return checkpoint_error(path + ": cannot create");
  const bool ok = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  return std::fclose(file) == 0 && ok ? Status() : checkpoint_error(path + ": write failed");
}

namespace {

template <class T>
std::vector<uint8_t> raw_bytes(const T* values, size_t count) {
  std::vector<uint8_t> bytes(count * sizeof(T));
  std::memcpy(bytes.data(), values, bytes.size());
  return bytes;
}

TensorToWrite bf16_tensor(std::string name, std::vector<int64_t> shape, const uint16_t* values) {
  size_t count = 1;
  for (int64_t d : shape) count *= size_t(d);
  return TensorToWrite{std::move(name), "BF16", std::move(shape), raw_bytes(values, count)};
}

// A BF16 [rows, cols] matrix as F8_E4M3 codes and its F32 block scales (scale_inv = block amax / 448).
void add_fp8(std::vector<TensorToWrite>* out, const std::string& name, int64_t rows, int64_t cols,
             const uint16_t* values) {
  const int64_t scale_rows = (rows + kScaleBlock - 1) / kScaleBlock, scale_cols = (cols + kScaleBlock - 1) / kScaleBlock;
  std::vector<float> scales(size_t(scale_rows * scale_cols), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float& amax = scales[size_t((r / kScaleBlock) * scale_cols + c / kScaleBlock)];
      amax = std::max(amax, std::fabs(num::bf16_to_float(values[r * cols + c])));
    }
  }
  for (float& s : scales) s = s > 0 ? s / num::kFp8E4M3Max : 1.0f;
  std::vector<uint8_t> codes(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = scales[size_t((r / kScaleBlock) * scale_cols + c / kScaleBlock)];
      codes[size_t(r * cols + c)] = num::float_to_e4m3(num::bf16_to_float(values[r * cols + c]) / scale);
    }
  }
  out->push_back(TensorToWrite{name, "F8_E4M3", {rows, cols}, std::move(codes)});
  out->push_back(TensorToWrite{name + "_scale_inv", "F32", {scale_rows, scale_cols}, raw_bytes(scales.data(), scales.size())});
}

std::vector<uint16_t> floats_to_bf16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = num::float_to_bf16(values[i]);
  return out;
}

}  // namespace

std::vector<TensorToWrite> layer_tensors(const StepShape& s, const HostWeights& w, int layer, CheckpointDType dtype) {
  const int64_t H = s.H, P = s.P, V = s.V, L = s.L, D = s.D, Q = s.Q;
  std::vector<uint16_t> kv_b(size_t(H * (P + V) * L));
  for (int64_t h = 0; h < H; ++h) {
    uint16_t* head = kv_b.data() + h * (P + V) * L;
    std::copy_n(w.w_uk_t.data() + h * P * L, P * L, head);
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t l = 0; l < L; ++l) head[(P + v) * L + l] = w.w_uv[size_t(h * L * V + l * V + v)];
    }
  }
  const bool fp8 = dtype == CheckpointDType::kFp8Block;
  std::vector<TensorToWrite> out;
  // The projections DeepSeek-V3.2's FP8 checkpoint stores in FP8 blocks.
  const auto projection = [&](const std::string& suffix, int64_t rows, int64_t cols, const uint16_t* values) {
    const std::string name = layer_tensor_name(layer, suffix);
    if (fp8) {
      add_fp8(&out, name, rows, cols, values);
    } else {
      out.push_back(bf16_tensor(name, {rows, cols}, values));
    }
  };
  const auto bf16 = [&](const std::string& suffix, std::vector<int64_t> shape, const uint16_t* values) {
    out.push_back(bf16_tensor(layer_tensor_name(layer, suffix), std::move(shape), values));
  };
  projection("q_a_proj.weight", Q, D, w.fused_qkv_a_proj.data());
  bf16("q_a_layernorm.weight", {Q}, w.q_norm_gamma.data());
  projection("q_b_proj.weight", H * P, Q, w.q_b_proj.data());
  projection("kv_a_proj_with_mqa.weight", L, D, w.fused_qkv_a_proj.data() + Q * D);
  bf16("kv_a_layernorm.weight", {L}, w.kv_norm_gamma.data());
  projection("kv_b_proj.weight", H * (P + V), L, kv_b.data());
  projection("o_proj.weight", D, H * V, w.o_proj.data());
  projection("indexer.wq_b.weight", int64_t{s.index_heads} * kIndexerDim, Q, w.index_wq_b.data());
  projection("indexer.wk.weight", kIndexerDim, D, w.index_wk.data());
  bf16("indexer.weights_proj.weight", {s.index_heads, D}, w.index_weights_proj.data());
  bf16("indexer.k_norm.weight", {kIndexerDim}, floats_to_bf16(w.index_k_norm_weight).data());
  bf16("indexer.k_norm.bias", {kIndexerDim}, floats_to_bf16(w.index_k_norm_bias).data());
  bf16("indexer.index_kpool_compress_gate", {kIndexerDim, D}, w.index_compress_gate.data());
  if (fp8) {  // vLLM holds the pool bias in FP32; the FP8 layout writes it so (the F32 path of the loader)
    out.push_back(TensorToWrite{layer_tensor_name(layer, "indexer.index_kpool_compress_ape"), "F32",
                                {s.index_pool, kIndexerDim}, raw_bytes(w.index_ape.data(), w.index_ape.size())});
  } else {
    bf16("indexer.index_kpool_compress_ape", {s.index_pool, kIndexerDim}, floats_to_bf16(w.index_ape).data());
  }
  return out;
}

}  // namespace dsa::cli
