"""Room 5: calibration on anchors, uncertainty (Monte Carlo), the estimate of every scenario
case, and budget tuning from measured acceptance."""
