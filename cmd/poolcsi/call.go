package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/poolcsi/poolcsi/internal/report"
)

const callSynopsis = `call [--endpoint unix:///path/csi.sock] METHOD ['{json}']

Calls one CSI method on a driver's socket and prints the answer as JSON: a CSI
client for operators (csc, which did this, is archived). METHOD is a method of the
CSI spec, e.g. GetPluginInfo, Probe, ListVolumes, NodeGetInfo, or with its service,
Controller.ListVolumes. The request is the method's message in protojson (field
names as in the spec, e.g. {"volume_id": "..."} or {"volumeId": "..."}); none is
an empty request. A call that fails prints its gRPC code and message and exits 1.`

// callCmd is `poolcsi call`. The methods and their messages come from the CSI
// spec's own descriptors (csi.File_csi_proto), so every method of the spec the
// binary is built with can be called, with no table to keep up to date.
func callCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("call", callSynopsis, stderr)
	endpoint := fs.String("endpoint", "unix:///csi/csi.sock", "the driver's CSI socket")
	timeout := fs.Duration("timeout", 30*time.Second, "how long the call may take")
	if err := fs.Parse(args); err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) < 1 || len(rest) > 2 {
		fs.Usage()
		return errors.New("call: want METHOD and at most one JSON request")
	}
	m, err := findCSIMethod(rest[0])
	if err != nil {
		return err
	}
	req := dynamicpb.NewMessage(m.Input())
	if len(rest) == 2 {
		if err := protojson.Unmarshal([]byte(rest[1]), req); err != nil {
			return fmt.Errorf("call: request for %s: %w", m.Name(), err)
		}
	}
	conn, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("call: %w", err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	resp := dynamicpb.NewMessage(m.Output())
	full := fmt.Sprintf("/%s/%s", m.Parent().FullName(), m.Name())
	if err := conn.Invoke(ctx, full, req, resp); err != nil {
		// The driver's message is untrusted text bound for a terminal.
		if s, ok := status.FromError(err); ok {
			return fmt.Errorf("call %s: %s: %s", m.Name(), s.Code(), report.Printable(s.Message()))
		}
		return fmt.Errorf("call %s: %s", m.Name(), report.Printable(err.Error()))
	}
	raw, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(resp)
	if err != nil {
		return fmt.Errorf("call %s: answer: %w", m.Name(), err)
	}
	// protojson varies its spacing on purpose; indent it the one way, so the
	// output can be read and compared.
	var out bytes.Buffer
	if err := json.Indent(&out, raw, "", "  "); err != nil {
		return fmt.Errorf("call %s: answer: %w", m.Name(), err)
	}
	_, err = fmt.Fprintf(stdout, "%s\n", report.EscapeJSON(out.Bytes()))
	return err
}

// findCSIMethod finds a unary method of the CSI spec by its name, or by
// Service.Method where a name is in two services.
func findCSIMethod(name string) (protoreflect.MethodDescriptor, error) {
	service, method, qualified := strings.Cut(name, ".")
	if !qualified {
		service, method = "", name
	}
	var found []protoreflect.MethodDescriptor
	var all []string
	services := csi.File_csi_proto.Services()
	for i := range services.Len() {
		s := services.Get(i)
		methods := s.Methods()
		for j := range methods.Len() {
			m := methods.Get(j)
			if m.IsStreamingClient() || m.IsStreamingServer() {
				continue // a unary call prints one answer; the streams are not for this
			}
			all = append(all, string(m.Name()))
			if string(m.Name()) == method && (service == "" || string(s.Name()) == service) {
				found = append(found, m)
			}
		}
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
		return nil, fmt.Errorf("call: no CSI method %q; the unary ones are: %s", name, strings.Join(all, ", "))
	}
	return nil, fmt.Errorf("call: %q is in several CSI services: name it as Service.%s", name, method)
}
