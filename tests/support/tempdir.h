#pragma once
// A temporary directory removed (recursively) when the object goes away. On a real
// filesystem (/var/tmp) unless asked for tmpfs, because page-cache tests need one.
#include <string>

namespace spark::test {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "spark-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  /// path() + "/" + name
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  /// Writes a file under the directory (creating parent directories).
  std::string write(const std::string& name, const std::string& content) const;

 private:
  std::string path_;
};

}  // namespace spark::test
