package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// PKI is the throw-away certificate setup of one test control plane, all under Dir.
type PKI struct {
	Dir                       string
	CACert                    string
	ServingCert, ServingKey   string // kube-apiserver, for 127.0.0.1 and localhost
	AdminCert, AdminKey       string // CN=poolcsi-test-admin, O=system:masters
	SAPublicKey, SASigningKey string // service-account token keys
	caCert                    *x509.Certificate
	caKey                     *ecdsa.PrivateKey
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// NewPKI generates a CA, a serving certificate, an admin client certificate and the
// service-account key pair.
func NewPKI(dir string) (*PKI, error) {
	p := &PKI{Dir: dir}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "poolcsi-test-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, ca, ca, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	p.caCert, _ = x509.ParseCertificate(der)
	p.caKey = key
	p.CACert = filepath.Join(dir, "ca.crt")
	if err := writePEM(p.CACert, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	p.ServingCert, p.ServingKey, err = p.issue("serving", pkix.Name{CommonName: "kube-apiserver"}, true, 2)
	if err != nil {
		return nil, err
	}
	p.AdminCert, p.AdminKey, err = p.issue("admin", pkix.Name{CommonName: "poolcsi-test-admin", Organization: []string{"system:masters"}}, false, 3)
	if err != nil {
		return nil, err
	}
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	p.SASigningKey = filepath.Join(dir, "sa.key")
	p.SAPublicKey = filepath.Join(dir, "sa.pub")
	if err := writePEM(p.SASigningKey, "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(sa)); err != nil {
		return nil, err
	}
	pub, err := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	if err != nil {
		return nil, err
	}
	if err := writePEM(p.SAPublicKey, "PUBLIC KEY", pub); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *PKI) issue(name string, subj pkix.Name, server bool, serial int64) (string, string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: subj,
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		// The kubernetes Service's address and the host's own: pods reach the API server
		// through either.
		tmpl.IPAddresses = append([]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(ServiceIP)}, hostIPs()...)
		tmpl.DNSNames = []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"}
	} else {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &key.PublicKey, p.caKey)
	if err != nil {
		return "", "", err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return "", "", err
	}
	c, k := filepath.Join(p.Dir, name+".crt"), filepath.Join(p.Dir, name+".key")
	if err := writePEM(c, "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	return c, k, writePEM(k, "EC PRIVATE KEY", kder)
}

// ServiceIP is the kubernetes Service's ClusterIP: the first address of the API server's
// --service-cluster-ip-range.
const ServiceIP = "10.96.0.1"

// hostIPs lists this machine's non-loopback IPv4 addresses.
func hostIPs() []net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var out []net.IP
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			out = append(out, n.IP)
		}
	}
	return out
}
