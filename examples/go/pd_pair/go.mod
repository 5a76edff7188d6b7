module pd_pair

go 1.19
