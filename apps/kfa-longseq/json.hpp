#pragma once
// kfa-longseq: the JSON summary's writer. One object built key by key: strings escaped, non-finite numbers
// as null, nested objects; no dependency beyond the standard library.
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>

namespace longseq {

class Json {
 public:
  struct Value {
    std::string text;
  };
  static Value null() { return {"null"}; }
  static Value str(const std::string& x) { return {"\"" + escape(x) + "\""}; }
  static Value num(double x) {
    if (!std::isfinite(x)) return null();
    char b[32];
    std::snprintf(b, sizeof b, "%.9g", x);
    return {b};
  }
  Json& add(const std::string& key, const Value& v) {
    m_text += (m_text.empty() ? "" : ", ") + str(key).text + ": " + v.text;
    return *this;
  }
  Json& add(const std::string& key, const std::string& v) { return add(key, str(v)); }
  Json& add(const std::string& key, const char* v) { return add(key, str(v)); }
  Json& add(const std::string& key, bool v) { return add(key, Value{v ? "true" : "false"}); }
  Json& add(const std::string& key, double v) { return add(key, num(v)); }
  template <class I,
            typename std::enable_if<std::is_integral<I>::value && !std::is_same<I, bool>::value, int>::type = 0>
  Json& add(const std::string& key, I v) {
    return add(key, Value{std::to_string(v)});
  }
  Json& add(const std::string& key, const Json& v) { return add(key, Value{v.text()}); }
  std::string text() const { return "{" + m_text + "}"; }

 private:
  static std::string escape(const std::string& s) {
    std::string o;
    for (char ch : s) {
      if (ch == '"' || ch == '\\') {
        o += '\\', o += ch;
      } else if (static_cast<unsigned char>(ch) < 0x20) {
        char u[8];
        std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
        o += u;
      } else {
        o += ch;
      }
    }
    return o;
  }
  std::string m_text;
};

}  // namespace longseq
