"""xdc.monitor"""
