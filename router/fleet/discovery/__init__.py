"""Membership sources that discover replicas (DNS, Kubernetes): each reports to a
`router.fleet.membership.MembershipSink`."""
