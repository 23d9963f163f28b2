#include "env/sysroot.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "core/strings.h"

namespace spark::env {

Sysroot::Sysroot(std::string root) : rec_(std::make_shared<Recorder>()) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  root_ = (root == "/" || root.empty()) ? std::string() : root;
}

std::string Sysroot::path(std::string_view abs) const {
  std::string p(abs);
  if (root_.empty() && !p.empty()) return p;  // live: relative paths stay relative to the cwd
  if (p.empty() || p[0] != '/') p = "/" + p;
  return root_ + p;
}

void Sysroot::note(std::string_view abs, Kind k) const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  if (!rec_->on) return;
  (k == Kind::dir     ? rec_->dirs
   : k == Kind::sized ? rec_->sized
                      : rec_->files)
      .insert(std::string(abs));
}

std::optional<std::string> Sysroot::read(std::string_view abs) const {
  note(abs, Kind::file);
  return read_file(path(abs));
}

std::optional<std::string> Sysroot::read_line(std::string_view abs) const {
  auto t = read(abs);
  if (!t) return std::nullopt;
  auto nl = t->find('\n');
  return std::string(trim(std::string_view(*t).substr(0, nl)));
}

std::vector<std::string> Sysroot::list(std::string_view abs) const {
  note(abs, Kind::dir);
  std::vector<std::string> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(path(abs), ec), end; !ec && it != end;
       it.increment(ec))
    out.push_back(it->path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool Sysroot::exists(std::string_view abs) const {
  struct stat st {};
  return ::stat(path(abs).c_str(), &st) == 0;
}

std::optional<uint64_t> Sysroot::file_size(std::string_view abs) const {
  note(abs, Kind::sized);
  struct stat st {};
  if (::stat(path(abs).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return static_cast<uint64_t>(st.st_size);
}

void Sysroot::record(bool on) {
  std::lock_guard<std::mutex> lock(rec_->mu);
  rec_->on = on;
}

std::set<std::string> Sysroot::recorded_files() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->files;
}

std::set<std::string> Sysroot::recorded_dirs() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->dirs;
}

}  // namespace spark::env

namespace spark::env {
std::set<std::string> Sysroot::recorded_sized() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->sized;
}
}  // namespace spark::env
