"""Membership sources that find replicas on their own (DNS, Kubernetes) and report them to the
fleet registry through `router.fleet.membership.MembershipSink`."""
