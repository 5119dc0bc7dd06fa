package translate

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
)

// Validate runs the protoc-gen-validate rules of m and of every message packed in an Any inside
// it, unpacked: go-control-plane's Validate does not descend into Any, and a typed_config Envoy
// would reject is exactly what a golden file cannot show.
func Validate(m proto.Message) error {
	return validateMessage(m.ProtoReflect(), string(proto.MessageName(m)))
}

type validator interface{ ValidateAll() error }

func validateMessage(m protoreflect.Message, path string) error {
	var errs []error
	if v, ok := m.Interface().(validator); ok {
		if err := v.ValidateAll(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", path, err))
		}
	}
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			return fmt.Errorf("%s: unpack %s: %w", path, a.GetTypeUrl(), err)
		}
		return validateMessage(inner.ProtoReflect(), path+"("+string(proto.MessageName(inner))+")")
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() == nil || fd.IsMap() && fd.MapValue().Message() == nil {
			return true
		}
		p := path + "." + string(fd.Name())
		switch {
		case fd.IsList():
			for i := 0; i < v.List().Len(); i++ {
				errs = append(errs, validateMessage(v.List().Get(i).Message(), fmt.Sprintf("%s[%d]", p, i)))
			}
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				errs = append(errs, validateMessage(mv.Message(), fmt.Sprintf("%s[%v]", p, k)))
				return true
			})
		default:
			errs = append(errs, validateMessage(v.Message(), p))
		}
		return true
	})
	return errors.Join(errs...)
}
