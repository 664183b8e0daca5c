#include "tests/integration/test_pki.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace proxima::testing {

TestPki::TestPki() {
  char tmpl[] = "/tmp/proxima-pki-XXXXXX";
  dir_ = mkdtemp(tmpl);
}

TestPki::~TestPki() { std::filesystem::remove_all(dir_); }

std::string TestPki::Write(const std::string& name, const std::string& text) const {
  std::ofstream(Path(name)) << text;
  return Path(name);
}

bool TestPki::Run(std::vector<std::string> argv) {
  argv.insert(argv.begin(), "/usr/bin/openssl");
  CommandResult r = RunCommand(argv, absl::Seconds(30));
  if (r.exit_code != 0) ADD_FAILURE() << absl::StrJoin(argv, " ") << ": " << r.err;
  return r.exit_code == 0;
}

bool TestPki::MakeCa(const std::string& name) {
  return Run({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", Path(name + ".key"), "-out", Path(name + ".crt"), "-days", "2", "-subj",
              "/CN=proxima test " + name});
}

bool TestPki::MakeCert(const std::string& name, const std::string& ca, const std::string& ext) {
  const std::string ext_file = Write(name + ".ext", ext + "\n");
  return Run({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", Path(name + ".key"), "-out", Path(name + ".csr"), "-subj",
              "/CN=" + name}) &&
         Run({"x509", "-req", "-in", Path(name + ".csr"), "-CA", Path(ca + ".crt"), "-CAkey",
              Path(ca + ".key"), "-CAcreateserial", "-out", Path(name + ".crt"), "-days", "2",
              "-extfile", ext_file});
}

}  // namespace proxima::testing
