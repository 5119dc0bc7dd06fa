package harness

import (
	"fmt"
	"slices"
)

// Problems lists what a clean run does not have: a measurement with errors,
// without a successful connection or without bytes; a shoot that no counted
// connection through a target reached; an upstream that answered no request
// of a kind that was measured, or saw a ClientHello for another shoot's host.
// Skipped targets are not problems here (TargetInfo.Skipped says why). A mini
// run in a test expects none; a real run on a busy machine may have some.
func (rep *Report) Problems() []string {
	var ps []string
	add := func(format string, args ...any) { ps = append(ps, fmt.Sprintf(format, args...)) }
	reached := map[string][]int64{}
	for _, r := range rep.RateRuns {
		if r.Conns == 0 {
			add("rate c=%d %s: no successful connection", r.Concurrency, r.Target)
		}
		if len(r.Errors) > 0 {
			add("rate c=%d %s: %s (first: %v)", r.Concurrency, r.Target, fmtErrors(r.Errors), r.ErrorSamples)
		}
		if reached[r.Target] == nil {
			reached[r.Target] = make([]int64, len(r.PerShoot))
		}
		for i, n := range r.PerShoot {
			reached[r.Target][i] += n
		}
	}
	for _, name := range rep.targetOrder() {
		for i, n := range reached[name] {
			if n == 0 {
				add("%s: no verified connection reached shoot %d's upstream", name, i)
			}
		}
	}
	for _, r := range rep.BulkRuns {
		if r.Bytes == 0 {
			add("bulk %s: no bytes", r.Target)
		}
		if len(r.Errors) > 0 {
			add("bulk %s: %s (first: %v)", r.Target, fmtErrors(r.Errors), r.ErrorSamples)
		}
	}
	rate, bulk := len(rep.RateRuns) > 0, len(rep.BulkRuns) > 0
	for _, u := range rep.Upstreams {
		if rate && u.Small == 0 {
			add("upstream %s answered no small request", u.Host)
		}
		if bulk && u.Bulk == 0 && slices.ContainsFunc(rep.BulkRuns, func(r *BulkRun) bool { return r.Transfers > 0 }) {
			add("upstream %s answered no bulk request", u.Host)
		}
		if u.Misrouted > 0 {
			add("upstream %s got %d ClientHellos for another host", u.Host, u.Misrouted)
		}
	}
	return ps
}
