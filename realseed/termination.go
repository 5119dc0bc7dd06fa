package realseed

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/xds/translate"
)

// Identity is what the shoot's kube-apiserver says of a client (its SelfSubjectReview).
type Identity struct {
	User   string
	Groups []string
	// CredentialID is kube-apiserver's record of the client certificate (the extra
	// authentication.kubernetes.io/credential-id, X509SHA256=<fingerprint>): its own when it
	// verified the certificate, the terminating ingress's header when that did.
	CredentialID string
}

// AuthUse is what CheckAuthentication saw.
type AuthUse struct {
	// Owner is the owner's certificate client (kubectl auth whoami); Forged a token client that
	// sent X-Remote-User and X-Remote-Group of its own.
	Owner, Forged Identity
	// Terminated is how many more of the shoot's connections the ingress handed to its
	// terminating proxy meanwhile, Stripped how many more requests it dropped X-Remote-*
	// headers from.
	Terminated, Stripped float64
}

// forgedUser is the identity a client claims in authenticating-proxy headers of its own.
const forgedUser = "mallory"

// CheckAuthentication asks the shoot's kube-apiserver who its clients are, as they come through
// the ingress: the owner's client certificate (kubectl auth whoami, by the API server's name),
// and a token client that forges the authenticating proxy's headers. Both must come out as
// they are: the owner with the certificate's user, groups and credential id (the certificate's
// fingerprint), the token client as the token's user. For a shoot with per-request balancing
// the ingress terminates both (it counts the connections) and drops the forged headers (it
// counts the request stripped), and kube-apiserver learns the owner from its headers; for a
// passthrough shoot kube-apiserver verifies the certificate itself and ignores the forged
// headers, which come without the front-proxy certificate.
func (c *Cluster) CheckAuthentication(ctx context.Context, s *Shoot, inst *Installation) (*AuthUse, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	terminated, stripped := s.terminatedConnections(), s.strippedRequests()
	before, err := c.ingressMetrics(ctx, inst, terminated, stripped)
	if err != nil {
		return nil, err
	}
	use := &AuthUse{}
	out, err := c.kubectl(ctx, s, "auth", "whoami", "-o", "json").Output()
	if err != nil {
		return nil, fmt.Errorf("kubectl auth whoami: %w: %s", err, out)
	}
	var review authenticationv1.SelfSubjectReview
	if err := json.Unmarshal(out, &review); err != nil {
		return nil, fmt.Errorf("kubectl auth whoami: %w: %s", err, out)
	}
	use.Owner = identity(review.Status.UserInfo)

	forged := rest.CopyConfig(s.REST)
	forged.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return headerRoundTripper{rt, http.Header{"X-Remote-User": {forgedUser}, "X-Remote-Group": {user.SystemPrivilegedGroup, forgedUser}}}
	}
	kube, err := kubernetes.NewForConfig(forged)
	if err != nil {
		return nil, err
	}
	got, err := kube.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("SelfSubjectReview with forged headers: %w", err)
	}
	use.Forged = identity(got.Status.UserInfo)
	after, err := c.ingressMetrics(ctx, inst, terminated, stripped)
	if err != nil {
		return nil, err
	}
	use.Terminated, use.Stripped = after[0]-before[0], after[1]-before[1]

	if use.Owner.User != ShootOwnerUser || !slices.Contains(use.Owner.Groups, user.SystemPrivilegedGroup) {
		return use, fmt.Errorf("the owner's certificate is %s %v to kube-apiserver, want %s in %s", use.Owner.User, use.Owner.Groups, ShootOwnerUser, user.SystemPrivilegedGroup)
	}
	if use.Forged.User == forgedUser || slices.Contains(use.Forged.Groups, forgedUser) {
		return use, fmt.Errorf("kube-apiserver took the forged headers: the token client is %s %v", use.Forged.User, use.Forged.Groups)
	}
	// Either way kube-apiserver records the certificate's own credential id: verified by
	// itself, or passed by the terminating ingress (as its x509 authenticator would make it).
	fp, err := s.ownerFingerprint()
	if err != nil {
		return use, err
	}
	if want := "X509SHA256=" + fp; use.Owner.CredentialID != want {
		return use, fmt.Errorf("kube-apiserver's credential id of the owner is %q, want %q", use.Owner.CredentialID, want)
	}
	if s.cfg.PerRequest {
		// kubectl opens a connection of its own; the token client may reuse one its
		// transport (shared with the shoot's other clients) holds.
		if use.Terminated < 1 || use.Stripped < 1 {
			return use, fmt.Errorf("the ingress terminated %v connections and stripped %v requests, want at least 1 of each", use.Terminated, use.Stripped)
		}
		return use, nil
	}
	if use.Terminated != 0 || use.Stripped != 0 {
		return use, fmt.Errorf("a passthrough shoot: the ingress terminated %v connections and stripped %v requests", use.Terminated, use.Stripped)
	}
	return use, nil
}

func (s *Shoot) balancing() string {
	if s.cfg.PerRequest {
		return ", per request"
	}
	return ""
}

// authenticatedBy says in a check's line who verifies the shoot's client certificates.
func (s *Shoot) authenticatedBy() string {
	if s.cfg.PerRequest {
		return " by the terminating ingress's headers"
	}
	return " itself"
}

func identity(u authenticationv1.UserInfo) Identity {
	id := Identity{User: u.Username, Groups: u.Groups}
	if v := u.Extra[user.CredentialIDKey]; len(v) == 1 {
		id.CredentialID = v[0]
	}
	return id
}

// ownerFingerprint is the hex SHA-256 of the owner's certificate, as kube-apiserver's x509
// authenticator writes it into the credential id.
func (s *Shoot) ownerFingerprint() (string, error) {
	b, err := os.ReadFile(filepath.Join(s.dir, shootPKIOwnerCert))
	if err != nil {
		return "", err
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return "", fmt.Errorf("%s: no PEM", shootPKIOwnerCert)
	}
	sum := sha256.Sum256(blk.Bytes)
	return hex.EncodeToString(sum[:]), nil
}

type headerRoundTripper struct {
	next http.RoundTripper
	add  http.Header
}

func (h headerRoundTripper) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range h.add {
		r.Header[k] = v
	}
	return h.next.RoundTrip(r)
}

// metricSeries selects the samples of one metric whose labels include every one of labels
// (name="value", as Prometheus's text format writes them).
type metricSeries struct {
	name   string
	labels []string
}

// terminatedConnections is the ingress's count of the shoot's connections handed to its
// terminating proxy; strippedRequests its count of the shoot's requests it dropped X-Remote-*
// headers from.
func (s *Shoot) terminatedConnections() metricSeries {
	return metricSeries{"tendril_ingress_connections_total", []string{`cluster="` + translate.SNICluster(s.Host) + `"`, `outcome="terminated"`}}
}

func (s *Shoot) strippedRequests() metricSeries {
	return metricSeries{"tendril_ingress_terminate_stripped_requests_total", []string{`listener="` + translate.TerminateListener(s.Namespace) + `"`}}
}

// sum adds up the series' samples in a metrics page.
func (m metricSeries) sum(page []byte) (float64, error) {
	var n float64
	for _, line := range strings.Split(string(page), "\n") {
		name, rest, ok := strings.Cut(line, "{")
		if !ok || name != m.name {
			continue
		}
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok {
			return 0, fmt.Errorf("metrics: %q", line)
		}
		match := true
		for _, l := range m.labels {
			match = match && slices.Contains(strings.Split(labels, ","), l)
		}
		if !match {
			continue
		}
		v, err := strconv.ParseFloat(strings.Fields(value)[0], 64)
		if err != nil {
			return 0, fmt.Errorf("metrics: %q: %w", line, err)
		}
		n += v
	}
	return n, nil
}

// ingressMetrics sums each series over every running tendril-ingress pod, read through the
// seed's API server's pod proxy.
func (c *Cluster) ingressMetrics(ctx context.Context, inst *Installation, series ...metricSeries) ([]float64, error) {
	_, pods, err := deploymentPods(ctx, c.Client, inst.Namespace, "tendril-ingress")
	if err != nil {
		return nil, err
	}
	sums := make([]float64, len(series))
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			continue
		}
		page, err := c.kube.CoreV1().Pods(inst.Namespace).ProxyGet("http", p.Name, strconv.Itoa(ingressMetricsPort), "/metrics", nil).DoRaw(ctx)
		if err != nil {
			return nil, fmt.Errorf("tendril-ingress's metrics in %s/%s: %w", inst.Namespace, p.Name, err)
		}
		for i, m := range series {
			v, err := m.sum(page)
			if err != nil {
				return nil, fmt.Errorf("%s/%s: %w", inst.Namespace, p.Name, err)
			}
			sums[i] += v
		}
	}
	return sums, nil
}

// ingressMetricsPort is the chart's ingress.metricsPort.
const ingressMetricsPort = 18081

// WatchUse is what WatchThroughRotation saw.
type WatchUse struct {
	// Events is how many ConfigMaps the watch saw created (all of them, in order); Dials how
	// many connections its client opened (1: the watch never broke).
	Events, Dials int
	// MaxLag is the longest time from a create's response to the watch's event for it.
	MaxLag time.Duration
	// Rotated is how long after gardenlet's new serving certificate a new connection through
	// the ingress was served with it (the extension reconciled, the control plane published
	// it, the ingress took it).
	Rotated time.Duration
}

// watchProbeLabel marks the ConfigMaps WatchThroughRotation creates.
const watchProbeLabel = "tendril.dev/watch-probe"

// WatchThroughRotation holds one watch of the shoot's ConfigMaps through the ingress for d, as
// the owner (client certificate), while another client creates one every second; halfway,
// gardenlet issues kube-apiserver a new serving certificate and reconciles the Extension. Every
// create must reach the watch in order, over the one connection the watch opened, and a new
// connection through the ingress must be served the new certificate. It is meant for a shoot
// with per-request balancing (the ingress terminates its TLS); on a passthrough shoot
// kube-apiserver's pods keep serving the certificate they mounted.
func (c *Cluster) WatchThroughRotation(ctx context.Context, s *Shoot, d time.Duration) (*WatchUse, error) {
	ctx, cancel := context.WithTimeout(ctx, d+2*time.Minute)
	defer cancel()
	var dials atomic.Int32
	rc := rest.CopyConfig(s.REST)
	rc.BearerToken = ""
	rc.CertFile, rc.KeyFile = filepath.Join(s.dir, shootPKIOwnerCert), filepath.Join(s.dir, shootPKIOwnerKey)
	dialer := &net.Dialer{Timeout: 10 * time.Second}
	rc.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return dialer.DialContext(ctx, network, addr)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	cms := kube.CoreV1().ConfigMaps(metav1.NamespaceDefault)
	w, err := cms.Watch(ctx, metav1.ListOptions{LabelSelector: watchProbeLabel})
	if err != nil {
		return nil, fmt.Errorf("watch: %w", err)
	}
	defer w.Stop()
	defer func() {
		_ = s.Client.DeleteAllOf(context.WithoutCancel(ctx), &corev1.ConfigMap{}, client.InNamespace(metav1.NamespaceDefault), client.HasLabels{watchProbeLabel})
	}()

	use := &WatchUse{}
	start := time.Now()
	var rotatedAt time.Time
	var newCert []byte // DER
	for i := 0; time.Since(start) < d; i++ {
		if rotatedAt.IsZero() && time.Since(start) >= d/2 {
			pemCert, err := c.RotateServingCertificate(ctx, s)
			if err != nil {
				return use, fmt.Errorf("rotate the serving certificate: %w", err)
			}
			blk, _ := pem.Decode(pemCert)
			if blk == nil {
				return use, fmt.Errorf("the new serving certificate is no PEM")
			}
			newCert = blk.Bytes
			rotatedAt = time.Now()
			if err := c.reconcileExtension(ctx, s); err != nil {
				return use, err
			}
		}
		name := fmt.Sprintf("watch-probe-%d", i)
		if err := s.Client.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault,
			Labels: map[string]string{watchProbeLabel: "true"}}}); err != nil {
			return use, fmt.Errorf("create ConfigMap %s: %w", name, err)
		}
		created := time.Now()
		if err := nextAdded(ctx, w, name); err != nil {
			return use, fmt.Errorf("after %d events in %s: %w", use.Events, time.Since(start).Round(time.Second), err)
		}
		use.Events++
		use.MaxLag = max(use.MaxLag, time.Since(created))
		if newCert != nil && use.Rotated == 0 {
			if served, err := c.servedCertificate(ctx, s); err == nil && bytes.Equal(served, newCert) {
				use.Rotated = time.Since(rotatedAt)
			}
		}
		select {
		case <-ctx.Done():
			return use, ctx.Err()
		case <-time.After(time.Second):
		}
	}
	use.Dials = int(dials.Load())
	switch {
	case newCert == nil:
		return use, fmt.Errorf("the watch ended before the rotation")
	case use.Rotated == 0:
		return use, fmt.Errorf("the ingress still serves the old certificate %s after the rotation", time.Since(rotatedAt).Round(time.Second))
	case use.Dials != 1:
		return use, fmt.Errorf("the watch's client opened %d connections, want 1: the connection broke", use.Dials)
	}
	return use, nil
}

// nextAdded waits for w's next event, which must be the ADDED of ConfigMap name.
func nextAdded(ctx context.Context, w watch.Interface, name string) error {
	select {
	case <-ctx.Done():
		return fmt.Errorf("no event for ConfigMap %s: %w", name, ctx.Err())
	case ev, ok := <-w.ResultChan():
		if !ok {
			return fmt.Errorf("the watch ended before ConfigMap %s", name)
		}
		cm, isCM := ev.Object.(*corev1.ConfigMap)
		if ev.Type != watch.Added || !isCM || cm.Name != name {
			return fmt.Errorf("event %s %T, want ADDED of ConfigMap %s", ev.Type, ev.Object, name)
		}
		return nil
	}
}

// servedCertificate is the leaf certificate (DER) a new TLS connection to the ingress's SNI
// listener with the shoot's name is served.
func (c *Cluster) servedCertificate(ctx context.Context, s *Shoot) ([]byte, error) {
	u, err := url.Parse(s.REST.Host)
	if err != nil {
		return nil, err
	}
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: 5 * time.Second}, Config: &tls.Config{ServerName: s.Host, InsecureSkipVerify: true}}
	conn, err := d.DialContext(ctx, "tcp", u.Host)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	certs := conn.(*tls.Conn).ConnectionState().PeerCertificates
	if len(certs) == 0 {
		return nil, fmt.Errorf("no certificate served")
	}
	return certs[0].Raw, nil
}

// reconcileExtension asks for a reconcile of the shoot's Extension as gardenlet does after a
// change (its operation annotation).
func (c *Cluster) reconcileExtension(ctx context.Context, s *Shoot) error {
	var ext extensionsv1alpha1.Extension
	key := client.ObjectKey{Namespace: s.Namespace, Name: extension.Type}
	if err := c.Client.Get(ctx, key, &ext); err != nil {
		return err
	}
	patch := client.MergeFrom(ext.DeepCopy())
	metav1.SetMetaDataAnnotation(&ext.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationReconcile)
	if err := c.Client.Patch(ctx, &ext, patch); err != nil {
		return fmt.Errorf("annotate Extension %s: %w", key, err)
	}
	return nil
}
