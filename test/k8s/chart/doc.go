// Package chart holds the tests of poolcsi's Helm chart and of what is generated from it:
// the plain YAML of deploy/kubernetes agrees with the chart (cmd/render regenerates it),
// the versions agree with the VERSION file, the values schema, the GitOps and monitoring
// variants. The renderer they use is the release tools' (hack/release/chart), which make
// release packages the chart with.
package chart
