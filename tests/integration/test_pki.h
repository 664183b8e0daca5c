// TestPki: a scratch directory of CAs and certificates made at test time by the openssl CLI
// (EC P-256, valid two days), for the TLS and mTLS integration tests. Removed when destroyed.
#ifndef PROXIMA_TESTS_INTEGRATION_TEST_PKI_H_
#define PROXIMA_TESTS_INTEGRATION_TEST_PKI_H_

#include <string>
#include <vector>

namespace proxima::testing {

class TestPki {
 public:
  TestPki();  // an empty directory under /tmp
  ~TestPki();
  TestPki(const TestPki&) = delete;
  TestPki& operator=(const TestPki&) = delete;

  // A self-signed CA: Path(name + ".crt") and Path(name + ".key"). Fails the test (and returns
  // false) when openssl does.
  bool MakeCa(const std::string& name);
  // A certificate `name` (CN=name) signed by CA `ca`, with the x509v3 extension lines `ext`
  // (e.g. "subjectAltName=IP:127.0.0.1" or "extendedKeyUsage=clientAuth").
  bool MakeCert(const std::string& name, const std::string& ca, const std::string& ext);

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // Writes `text` to Path(name) and returns the path.
  std::string Write(const std::string& name, const std::string& text) const;

 private:
  bool Run(std::vector<std::string> argv);
  std::string dir_;
};

}  // namespace proxima::testing

#endif  // PROXIMA_TESTS_INTEGRATION_TEST_PKI_H_
