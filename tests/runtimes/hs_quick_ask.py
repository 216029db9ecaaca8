"""The probe runtime with a 1.5 s approval timeout, so a test can see an
approval that nobody answers time out without waiting the probe's 60 s."""

from hermes_sup.worker import probe


def make(session):
    probe.APPROVAL_TIMEOUT = 1.5
    return probe.ProbeRuntime(session)
