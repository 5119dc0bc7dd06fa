package realseed

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"os"
	"path/filepath"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/internal/kube/kubescheme"
	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// controlPlanePKI writes what a kube-apiserver of this machine serves and signs with into dir,
// and returns the admin token: the CA (ca.crt), the serving certificate for names (tls.crt,
// tls.key), the service-account signing key (sa.key, sa.pub) and the token file (tokens.csv),
// whose one token is system:masters (the shortcut of a one-machine cluster).
func controlPlanePKI(dir, caName string, names ...string) (token string, err error) {
	ca, err := testpki.NewCA(caName)
	if err != nil {
		return "", err
	}
	if err := ca.WriteCA(filepath.Join(dir, "ca.crt")); err != nil {
		return "", err
	}
	serving, err := ca.Leaf(names...)
	if err != nil {
		return "", err
	}
	if err := testpki.WritePair(serving, filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")); err != nil {
		return "", err
	}
	if err := serviceAccountKeys(dir); err != nil {
		return "", err
	}
	return adminToken(dir)
}

// serviceAccountKeys writes a service-account signing key pair into dir (sa.key, sa.pub).
func serviceAccountKeys(dir string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644)
}

// adminToken writes a token file into dir (tokens.csv) whose one token, returned, is
// system:masters (the shortcut of a one-machine cluster).
func adminToken(dir string) (string, error) {
	tok := make([]byte, 16)
	if _, err := rand.Read(tok); err != nil {
		return "", err
	}
	token := hex.EncodeToString(tok)
	return token, os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(token+`,admin,admin,"system:masters"`+"\n"), 0o600)
}

// adminKubeconfig writes the admin kubeconfig of a cluster: server https://apiServer, verified
// against caFile (as serverName when not empty), the token; it returns clients made from it.
func adminKubeconfig(path, name, apiServer, serverName, caFile, token string, qps float32) (*rest.Config, kubernetes.Interface, client.Client, error) {
	data := map[string]string{"Name": name, "APIServer": apiServer, "ServerName": serverName, "CAFile": caFile, "Token": token}
	if err := render(kubeconfigYAML, data, path); err != nil {
		return nil, nil, nil, err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, nil, nil, err
	}
	rc.QPS, rc.Burst = qps, int(2*qps)
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, nil, nil, err
	}
	cl, err := client.New(rc, client.Options{Scheme: kubescheme.New()})
	return rc, kube, cl, err
}
