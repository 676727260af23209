"""``asyncrl dashboard``: a read-only web view of campaigns — the ladder, each candidate's
diagnostics, recipe diffs, rollouts and the registry (:mod:`ui.dashboard.app`)."""
