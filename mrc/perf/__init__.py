"""mrc-perf: perftest-style bandwidth and latency tool."""
