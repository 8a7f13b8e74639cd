"""Room 6: the estimator scored on the published corpus (``corpus``) and the attribution of
two measured engine runs' ratio (``diagnose``)."""
