"""xdc.transport"""
