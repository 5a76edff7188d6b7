// Control-plane security (SPEC §6, issue "reliability and security"): an optional shared secret
// that every gRPC call carries and every server checks, and optional TLS for every channel.
//
// The secret travels as call metadata (`pdlib-auth`) and is compared in constant time; without
// TLS it crosses the network in clear, so it keeps out misconfigured or stray peers (a decode of
// another deployment, a port scanner), not an attacker who can read the traffic: use TLS for
// that. With TLS, servers present tls_cert_file/tls_key_file; clients verify them against
// tls_ca_file; a server that also has tls_ca_file verifies the certificate a client presents
// (clients present their tls_cert_file when they have one). Every pdlib process of a deployment
// can therefore share one set of files: CA, and a certificate valid for every host it serves on.
#ifndef PDLIB_LIB_CONTROL_SECURITY_H_
#define PDLIB_LIB_CONTROL_SECURITY_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

struct ControlSecurity {
  std::string shared_secret;  // empty: no authentication
  std::string tls_cert_file;  // PEM; a server's certificate (or a client's, for mutual TLS)
  std::string tls_key_file;   // PEM private key of tls_cert_file
  std::string tls_ca_file;    // PEM roots that verify the other side
  bool tls() const { return !tls_cert_file.empty() || !tls_ca_file.empty(); }
};

// Checks that the files exist and the combination makes sense (a certificate needs its key).
Status ValidateSecurity(const ControlSecurity& security);

StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ControlSecurity& security);
StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ControlSecurity& security);

// Client side: attaches the shared secret (if any) to a call.
void AttachSecret(const ControlSecurity& security, grpc::ClientContext* context);

// Server side: OK when the call carries the right secret (or none is configured), else
// UNAUTHENTICATED with a message that does not echo what the peer sent.
grpc::Status CheckSecret(const ControlSecurity& security, const grpc::ServerContextBase& context);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_SECURITY_H_
