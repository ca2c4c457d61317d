//go:build !unix

package pgcluster

import "errors"

// RemoveWhenGone is not available on this platform: remove the cluster with Remove.
func (c *Cluster) RemoveWhenGone(pid int) error {
	return errors.New("pgcluster: RemoveWhenGone needs a Unix system")
}
