#include "lib/control/security.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"

namespace pdlib {
inline namespace v1 {
namespace control {
namespace {

constexpr char kSecretKey[] = "pdlib-auth";

StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::InvalidArgument(absl::StrFormat("%s '%s' cannot be read", what, path));
  }
  std::ostringstream out;
  out << in.rdbuf();
  if (out.str().empty()) {
    return Status::InvalidArgument(absl::StrFormat("%s '%s' is empty", what, path));
  }
  return out.str();
}

// Same length and bytes, in time that does not depend on where they differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

Status ValidateSecurity(const ControlSecurity& s) {
  if (s.tls_cert_file.empty() != s.tls_key_file.empty()) {
    return Status::InvalidArgument(
        "tls_cert_file and tls_key_file go together: set both or neither");
  }
  for (auto [path, what] :
       {std::pair{&s.tls_cert_file, "tls_cert_file"}, std::pair{&s.tls_key_file, "tls_key_file"},
        std::pair{&s.tls_ca_file, "tls_ca_file"}}) {
    if (path->empty()) continue;
    if (auto r = ReadFile(*path, what); !r.ok()) return r.status();
  }
  return Status::OK();
}

StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ControlSecurity& s) {
  if (!s.tls()) return grpc::InsecureServerCredentials();
  if (s.tls_cert_file.empty()) {
    return Status::InvalidArgument(
        "TLS: a control-plane server needs tls_cert_file and tls_key_file (tls_ca_file alone "
        "only verifies servers)");
  }
  auto cert = ReadFile(s.tls_cert_file, "tls_cert_file");
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(s.tls_key_file, "tls_key_file");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (!s.tls_ca_file.empty()) {
    auto ca = ReadFile(s.tls_ca_file, "tls_ca_file");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
    o.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  o.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(o);
}

StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ControlSecurity& s) {
  if (!s.tls()) return grpc::InsecureChannelCredentials();
  if (s.tls_ca_file.empty()) {
    return Status::InvalidArgument(
        "TLS: a control-plane client needs tls_ca_file to verify the server's certificate");
  }
  grpc::SslCredentialsOptions o;
  auto ca = ReadFile(s.tls_ca_file, "tls_ca_file");
  if (!ca.ok()) return ca.status();
  o.pem_root_certs = *ca;
  if (!s.tls_cert_file.empty()) {
    auto cert = ReadFile(s.tls_cert_file, "tls_cert_file");
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(s.tls_key_file, "tls_key_file");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  return grpc::SslCredentials(o);
}

void AttachSecret(const ControlSecurity& s, grpc::ClientContext* context) {
  if (!s.shared_secret.empty()) context->AddMetadata(kSecretKey, s.shared_secret);
}

grpc::Status CheckSecret(const ControlSecurity& s, const grpc::ServerContextBase& context) {
  if (s.shared_secret.empty()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find(kSecretKey);
  if (it != md.end() &&
      ConstantTimeEquals(std::string_view(it->second.data(), it->second.size()), s.shared_secret)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      it == md.end()
                          ? "control-plane peer sent no shared secret (auth_secret is set here)"
                          : "control-plane peer sent a wrong shared secret");
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
