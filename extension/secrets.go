package extension

import (
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"strconv"
	"time"

	extensionssecretsmanager "github.com/gardener/gardener/extensions/pkg/util/secret/manager"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"golang.org/x/crypto/curve25519"
)

// Names of the secrets-manager configs. The manager adds a hash of each config to the Secret's
// name, so the names in the shoot namespace differ; the manager finds them by these names.
const (
	// SecretsManagerIdentity is tendril's identity in the secrets manager; one identity for
	// the whole extension, as everything it generates serves the one tendril-server.
	SecretsManagerIdentity = "extension-tendril"

	SecretNameCA              = "ca-tendril"
	SecretNameServerTLS       = "tendril-server-tls"
	SecretNameAPIServerClient = "tendril-kube-apiserver-client"
	SecretNameServerWireGuard = "tendril-server-wireguard"
	SecretNameAgentWireGuard  = "tendril-agent-wireguard"
)

// Data keys of a WireGuard key Secret.
const (
	DataKeyPrivateKey = "private-key"
	DataKeyPublicKey  = "public-key"
)

// wireGuardKeyConfig makes the secrets manager generate a Curve25519 key pair. Its only field
// is the name, so the config hash never changes and the key never rotates by accident: a
// new key would cut every agent off until the shoot's objects are updated.
type wireGuardKeyConfig struct {
	Name string
}

func (c *wireGuardKeyConfig) GetName() string { return c.Name }

func (c *wireGuardKeyConfig) Generate() (secretsutils.DataInterface, error) {
	var priv [32]byte
	if _, err := rand.Read(priv[:]); err != nil {
		return nil, fmt.Errorf("wireguard key: %w", err)
	}
	// Clamp as WireGuard does (RFC 7748 §5), so the stored key is the canonical form `wg genkey` writes.
	priv[0] &= 248
	priv[31] = (priv[31] & 127) | 64
	pub, err := curve25519.X25519(priv[:], curve25519.Basepoint)
	if err != nil {
		return nil, fmt.Errorf("wireguard public key: %w", err)
	}
	return wireGuardKey{
		private: base64.StdEncoding.EncodeToString(priv[:]),
		public:  base64.StdEncoding.EncodeToString(pub),
	}, nil
}

type wireGuardKey struct{ private, public string }

func (k wireGuardKey) SecretData() map[string][]byte {
	return map[string][]byte{DataKeyPrivateKey: []byte(k.private), DataKeyPublicKey: []byte(k.public)}
}

// keepOldClientCertificate is how long kube-apiserver's previous client certificate Secret stays
// after a renewal. gardenlet applies kube-apiserver's Deployment in the same shoot reconciliation
// that rotates the CA (tendril's Extension comes before kube-apiserver) and again at least once
// per sync period (an hour by default); a day also covers reconciliations that failed and retried.
const keepOldClientCertificate = 24 * time.Hour

// caConfigs are the CAs, rotated with the shoot's CAs by SecretsManagerForCluster.
func caConfigs() []extensionssecretsmanager.SecretConfigWithOptions {
	return []extensionssecretsmanager.SecretConfigWithOptions{{
		Config: &secretsutils.CertificateSecretConfig{
			Name:       SecretNameCA,
			CommonName: SecretNameCA,
			CertType:   secretsutils.CACert,
		},
		Options: []secretsmanager.GenerateOption{secretsmanager.Persist()},
	}}
}

// AgentWireGuardSecretName is the secrets-manager name of agent i's WireGuard key. The first
// agent's keeps the name the one agent always had, so its key survives the shoot becoming HA.
func AgentWireGuardSecretName(i int) string {
	if i == 0 {
		return SecretNameAgentWireGuard
	}
	return SecretNameAgentWireGuard + "-" + strconv.Itoa(i)
}

// leafConfigs are everything signed by the CA (caData: the CA Secret's data) plus the WireGuard
// keys of the server and of agents agents. A key of an agent no longer run is cleaned up with the
// other unused secrets: an agent added again later gets a new key (in its Secret in the shoot as
// in tendril-server's arguments) but its recorded address.
func leafConfigs(namespace string, agents int, caData map[string][]byte) ([]extensionssecretsmanager.SecretConfigWithOptions, error) {
	ca, err := loadSigningCA(caData)
	if err != nil {
		return nil, err
	}
	svc := "tendril-server"
	server := ca.certificate(SecretNameServerTLS, svc, []string{
		svc, svc + "." + namespace, svc + "." + namespace + ".svc",
		svc + "." + namespace + ".svc.cluster.local",
	}, secretsutils.ServerCert)
	client := ca.certificate(SecretNameAPIServerClient, "kube-apiserver", nil, secretsutils.ClientCert)
	// The secrets manager renews a Secret with a validity at 80 % of it, as it does for its own
	// certificates.
	validity := secretsmanager.Validity(certificateValidity)
	cfgs := []extensionssecretsmanager.SecretConfigWithOptions{
		{Config: server, Options: []secretsmanager.GenerateOption{validity}},
		{
			// kube-apiserver presents this to tendril-server's egress front-ends. Its Deployment
			// mounts the Secret by name (the egress webhook sets the current one when gardenlet
			// applies the Deployment), so a renewed certificate must not delete the Secret the
			// running Deployment still names: a kube-apiserver pod started before gardenlet applied
			// the Deployment again would not start. The old one is kept for keepOldClientCertificate.
			Config: client,
			Options: []secretsmanager.GenerateOption{
				validity,
				secretsmanager.Rotate(secretsmanager.KeepOld),
				secretsmanager.IgnoreOldSecretsAfter(keepOldClientCertificate),
			},
		},
		{
			Config:  &wireGuardKeyConfig{Name: SecretNameServerWireGuard},
			Options: []secretsmanager.GenerateOption{secretsmanager.Persist()},
		},
	}
	for i := range agents {
		cfgs = append(cfgs, extensionssecretsmanager.SecretConfigWithOptions{
			Config:  &wireGuardKeyConfig{Name: AgentWireGuardSecretName(i)},
			Options: []secretsmanager.GenerateOption{secretsmanager.Persist()},
		})
	}
	return cfgs, nil
}
