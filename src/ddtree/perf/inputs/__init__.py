"""Room 4: what the estimator reads: scenario files, uncertain values, measured acceptance,
anchors from measurement records and the check that combined records agree."""
